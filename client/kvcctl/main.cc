// kvcctl: command-line client of kvcd. See README.md beside this file.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kvc/buffer_pool.h"
#include "kvcctl.h"

namespace {

constexpr char kUsage[] =
    "usage: kvcctl <command> [flags] [args]\n"
    "\n"
    "commands:\n"
    "  put <file.safetensors>     upload a KV cache (tensors layer.{l}.k/.v/.q_obs)\n"
    "  get <id> <out.safetensors> download a cache, --format=packed|dense\n"
    "  stat <id>                  show one cache\n"
    "  ls                         list caches (--prefix)\n"
    "  rm <id>...                 delete caches\n"
    "  info                       show server info of every replica\n"
    "  bench                      concurrent synthetic uploads and downloads\n"
    "  soak                       long randomized load with faults, verifying every byte\n"
    "\n"
    "global flags (any command): --target=127.0.0.1:50051 (host:port, a comma-separated list of\n"
    "  replicas, or dns:///name:port), --timeout=<seconds>, --token=<bearer token>,\n"
    "  --chunk_mib=<1..4>, --tls, --tls_ca=<pem>, --tls_cert=<pem>, --tls_key=<pem>\n"
    "'kvcctl <command> --help' lists a command's flags. Exit codes: 0 ok, 1 failure, 2 usage.\n";

}  // namespace

int main(int argc, char** argv) {
  kvc::ReuseLargeMallocs();  // multi-MiB message buffers: reused, not remapped per message
  std::vector<std::string> args(argv + 1, argv + argc);
  // The command is the first word that is neither a flag nor a global flag's separate value.
  size_t cmd_index = args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help" || a == "help") {
      if (i == 0) {
        std::fputs(kUsage, stdout);
        return kvc::ctl::kExitOk;
      }
    }
    if (a.rfind("-", 0) == 0) {
      const bool takes_value =
          a.find('=') == std::string::npos &&
          (a == "--target" || a == "--timeout" || a == "--token" || a == "--chunk_mib" ||
           a == "--tls_ca" || a == "--tls_cert" || a == "--tls_key");
      if (takes_value) ++i;
      continue;
    }
    cmd_index = i;
    break;
  }
  if (cmd_index == args.size()) {
    std::fprintf(stderr, "kvcctl: no command given\n\n%s", kUsage);
    return kvc::ctl::kExitUsage;
  }
  const std::string cmd = args[cmd_index];
  args.erase(args.begin() + cmd_index);
  if (cmd == "put") return kvc::ctl::RunPut(args);
  if (cmd == "get") return kvc::ctl::RunGet(args);
  if (cmd == "stat") return kvc::ctl::RunStat(args);
  if (cmd == "ls") return kvc::ctl::RunLs(args);
  if (cmd == "rm") return kvc::ctl::RunRm(args);
  if (cmd == "info") return kvc::ctl::RunInfo(args);
  if (cmd == "bench") return kvc::ctl::RunBench(args);
  if (cmd == "soak") return kvc::ctl::RunSoak(args);
  std::fprintf(stderr, "kvcctl: unknown command '%s'\n\n%s", cmd.c_str(), kUsage);
  return kvc::ctl::kExitUsage;
}
