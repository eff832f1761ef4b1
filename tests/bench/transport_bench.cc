// Transport benchmark: kvc PutCache/GetCache against kvcd on loopback, next to (a) a plain gRPC
// byte stream of the same message sizes on the same kind of channel (a raw service in a child
// process, as kvcd is one, that discards uploads and streams downloads from memory) and (b)
// Redis SET/GET of the same
// blobs over a minimal RESP client. Prints one table with GB/s and ratios vs the plain stream.
//
//   transport_bench [--reps=5] [--layers_4k=4] [--layers_32k=2] [--kvcd=PATH] [--redis=PATH]
//                   [--only=TEXT] [--dtype=f16|bf16] [--kvcd_flags="--flag=value ..."]
//
// Caches are Llama-3-8B-shaped layers (8 KV heads, 32 query heads, head_dim 128, fp16 or
// --dtype=bf16, 32 observation queries) at 4K and 32K tokens; only a few layers per cache (a
// 32K-token layer is 128 MiB of K+V), which does not change per-byte throughput. Each row is the
// median of --reps timed runs after one warm-up run.
#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/sync_stream.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "kvc/buffer_pool.h"
#include "kvc/client.h"
#include "kvc/client_wire.h"
#include "kvc/dtype.h"
#include "testing/kvcd_process.h"

#ifndef KVCD_PATH
#define KVCD_PATH ""
#endif

ABSL_FLAG(int, reps, 5, "timed runs per row (median reported), after one warm-up");
ABSL_FLAG(int, layers_4k, 4, "layers per 4K-token cache; 0 skips that size");
ABSL_FLAG(int, layers_32k, 2, "layers per 32K-token cache; 0 skips that size");
ABSL_FLAG(std::string, kvcd, KVCD_PATH, "kvcd binary");
ABSL_FLAG(std::string, redis, "redis-server", "redis-server binary; empty skips Redis");
ABSL_FLAG(int, kvcd_threads, 2, "kvcd --threads");
ABSL_FLAG(std::string, kvcd_flags, "", "more kvcd flags, space-separated (after the bench's own)");
ABSL_FLAG(std::string, dtype, "f16",
          "element type of the uploaded caches: f16, or bf16 (the dtype engines keep Llama-3's "
          "cache in; kvcd scores bf16 layers on AVX-512 BF16 dot products where the CPU has them)");
ABSL_FLAG(std::string, only, "",
          "run only the cases whose name contains this text (the plain stream rows always run: "
          "they are the baseline of the ratios); for profiling one path");

namespace {

namespace pb = kvcache::v1;
constexpr size_t kChunk = 4 << 20;
constexpr int kMaxMessage = 16 << 20;

// ---- (a) plain gRPC byte stream: raw methods on a callback generic service ----------------

class SinkService final : public grpc::CallbackGenericService {
 public:
  explicit SinkService(const std::vector<uint8_t>* source) : source_(source) {}

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    if (ctx->method() == "/bench.Sink/Download") return new Download(source_);
    // kvc::Client's PutCache lands here too (the client-only row): an empty reply is a valid,
    // empty PutCacheResponse.
    return new Upload(ctx->method() == "/kvcache.v1.KvCache/PutCache");
  }

 private:
  // Client stream: read and drop every message, answer with the byte count.
  class Upload final : public grpc::ServerGenericBidiReactor {
   public:
    explicit Upload(bool empty_reply) : empty_reply_(empty_reply) { StartRead(&in_); }
    void OnReadDone(bool ok) override {
      if (ok) {
        bytes_ += in_.Length();
        in_.Clear();
        StartRead(&in_);
        return;
      }
      grpc::Slice s(&bytes_, empty_reply_ ? 0 : sizeof(bytes_));
      out_ = grpc::ByteBuffer(&s, 1);
      StartWriteAndFinish(&out_, grpc::WriteOptions(), grpc::Status::OK);
    }
    void OnDone() override { delete this; }

   private:
    const bool empty_reply_;
    grpc::ByteBuffer in_, out_;
    uint64_t bytes_ = 0;
  };

  // Server stream: the request holds a byte count; send that many bytes from memory in chunks.
  class Download final : public grpc::ServerGenericBidiReactor {
   public:
    explicit Download(const std::vector<uint8_t>* source) : source_(source) { StartRead(&in_); }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request"));
        return;
      }
      // The 8-byte count may arrive split over slices (as the transport's reads fell).
      std::vector<grpc::Slice> s;
      uint8_t count[8];
      size_t have = 0;
      if (in_.Dump(&s).ok()) {
        for (const grpc::Slice& piece : s) {
          const size_t take = std::min(piece.size(), sizeof(count) - have);
          std::memcpy(count + have, piece.begin(), take);
          have += take;
        }
      }
      if (have < sizeof(count)) {
        Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "bad request"));
        return;
      }
      std::memcpy(&total_, count, sizeof(count));
      total_ = std::min<uint64_t>(total_, source_->size());
      Next();
    }
    void OnWriteDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
        return;
      }
      Next();
    }
    void OnDone() override { delete this; }

   private:
    void Next() {
      if (sent_ >= total_) {
        Finish(grpc::Status::OK);
        return;
      }
      const size_t n = std::min<uint64_t>(kChunk, total_ - sent_);
      grpc::Slice s(source_->data() + sent_, n, grpc::Slice::STATIC_SLICE);
      out_ = grpc::ByteBuffer(&s, 1);
      sent_ += n;
      StartWrite(&out_);
    }
    const std::vector<uint8_t>* source_;
    grpc::ByteBuffer in_, out_;
    uint64_t total_ = 0, sent_ = 0;
  };

  const std::vector<uint8_t>* source_;
};

// Serves the sink on 127.0.0.1 from a child process, as kvcd serves from its own: both ends of
// the plain stream then run in separate processes with their own gRPC threads, like the client
// and kvcd (in one process they would share one gRPC runtime). Fork happens before this process
// starts any gRPC or other threads. Returns the child's pid and sets *port.
pid_t ForkSink(uint64_t source_bytes, int* port) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid != 0) {
    close(fds[1]);
    if (pid < 0 || read(fds[0], port, sizeof(*port)) != sizeof(*port)) *port = 0;
    close(fds[0]);
    return pid;
  }
  close(fds[0]);
  prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlive the bench
  std::vector<uint8_t> source(source_bytes);
  std::mt19937_64 rng(11);
  for (size_t i = 0; i + 8 <= source.size(); i += 8) {
    const uint64_t x = rng();
    std::memcpy(source.data() + i, &x, 8);
  }
  SinkService sink(&source);
  grpc::ServerBuilder sb;
  int p = 0;
  sb.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &p);
  sb.RegisterCallbackGenericService(&sink);
  sb.SetMaxReceiveMessageSize(kMaxMessage);
  sb.SetMaxSendMessageSize(kMaxMessage);
  std::unique_ptr<grpc::Server> server = sb.BuildAndStart();
  if (server == nullptr) p = 0;
  (void)!write(fds[1], &p, sizeof(p));
  close(fds[1]);
  if (server != nullptr) server->Wait();  // until SIGTERM
  _exit(0);
}

// Uploads `tensors` (each sent as PutCache would: same framing and chunk sizes) to the sink.
bool PlainUpload(grpc::Channel* ch, const grpc::internal::RpcMethod& m,
                 const std::vector<std::pair<const uint8_t*, size_t>>& tensors) {
  grpc::ClientContext ctx;
  grpc::ByteBuffer resp;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> w(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(ch, m, &ctx, &resp));
  pb::ChunkHeader chunk;
  for (size_t t = 0; t < tensors.size(); ++t) {
    chunk.set_layer(static_cast<uint32_t>(t / 3));
    chunk.set_tensor(static_cast<pb::TensorKind>(1 + t % 3));
    for (const kvc::ChunkSpan& c : kvc::SplitChunks(tensors[t].second, kChunk)) {
      chunk.set_offset(c.offset);
      if (!w->Write(kvc::FramePutChunk(chunk, tensors[t].first + c.offset, c.size))) break;
    }
  }
  w->WritesDone();
  return w->Finish().ok();
}

// Downloads `total` bytes from the sink into `dst`, copying each payload once.
bool PlainDownload(grpc::Channel* ch, const grpc::internal::RpcMethod& m, uint64_t total,
                   uint8_t* dst) {
  grpc::ClientContext ctx;
  grpc::Slice req(&total, sizeof(total));
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> r(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(ch, m, &ctx,
                                                                    grpc::ByteBuffer(&req, 1)));
  grpc::ByteBuffer bb;
  std::vector<grpc::Slice> slices;
  uint64_t got = 0;
  bool overflow = false;
  while (r->Read(&bb)) {
    (void)bb.Dump(&slices);
    for (const grpc::Slice& s : slices) {
      if (got + s.size() > total) {
        overflow = true;
        break;
      }
      std::memcpy(dst + got, s.begin(), s.size());
      got += s.size();
    }
  }
  const grpc::Status st = r->Finish();
  if (!st.ok() || overflow || got != total) {
    std::fprintf(stderr, "plain download: status %d '%s', %llu of %llu bytes%s\n",
                 static_cast<int>(st.error_code()), st.error_message().c_str(),
                 static_cast<unsigned long long>(got), static_cast<unsigned long long>(total),
                 overflow ? ", more than asked for" : "");
    return false;
  }
  return true;
}

// ---- (b) Redis: the server, and a minimal RESP client -------------------------------------

class Redis {
 public:
  ~Redis() {
    if (fd_ >= 0) close(fd_);
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
  }

  absl::Status Start(const std::string& binary) {
    absl::StatusOr<int> port = kvc::testing::PickFreeLoopbackPort();
    if (!port.ok()) return port.status();
    const std::string p = std::to_string(*port);
    std::vector<std::string> args = {
        binary, "--port",           p,    "--bind",     "127.0.0.1", "--save", "", "--appendonly",
        "no",   "--protected-mode", "no", "--loglevel", "warning"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // Redis logs start-up warnings; keep the table readable.
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    const int rc = posix_spawnp(&pid_, binary.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      pid_ = -1;
      return absl::UnavailableError(absl::StrCat("cannot start ", binary));
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      fd_ = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(*port));
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
        int one = 1;
        setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return Command({"PING"}) ? absl::OkStatus() : absl::InternalError("redis: PING failed");
      }
      close(fd_);
      fd_ = -1;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return absl::UnavailableError("redis-server did not accept connections");
  }

  pid_t pid() const { return pid_; }

  bool Set(const std::string& key, const uint8_t* data, size_t n) {
    const std::string head =
        absl::StrCat("*3\r\n$3\r\nSET\r\n$", key.size(), "\r\n", key, "\r\n$", n, "\r\n");
    iovec iov[3] = {{const_cast<char*>(head.data()), head.size()},
                    {const_cast<uint8_t*>(data), n},
                    {const_cast<char*>("\r\n"), 2}};
    return WriteAll(iov, 3) && ReadLine() == "+OK";
  }

  // GET into dst (capacity n); the value must be exactly n bytes.
  bool Get(const std::string& key, uint8_t* dst, size_t n) {
    const std::string cmd = absl::StrCat("*2\r\n$3\r\nGET\r\n$", key.size(), "\r\n", key, "\r\n");
    iovec iov[1] = {{const_cast<char*>(cmd.data()), cmd.size()}};
    if (!WriteAll(iov, 1)) return false;
    if (ReadLine() != absl::StrCat("$", n)) return false;
    return ReadExact(dst, n) && ReadLine().empty();
  }

  bool Command(const std::vector<std::string>& words) {
    std::string cmd = absl::StrCat("*", words.size(), "\r\n");
    for (const std::string& w : words) absl::StrAppend(&cmd, "$", w.size(), "\r\n", w, "\r\n");
    iovec iov[1] = {{cmd.data(), cmd.size()}};
    if (!WriteAll(iov, 1)) return false;
    const std::string line = ReadLine();
    return !line.empty() && line[0] != '-';
  }

 private:
  bool WriteAll(iovec* iov, int n) {
    while (n > 0) {
      ssize_t w = writev(fd_, iov, n);
      if (w < 0) return false;
      while (n > 0 && static_cast<size_t>(w) >= iov->iov_len) {
        w -= static_cast<ssize_t>(iov->iov_len);
        ++iov;
        --n;
      }
      if (n > 0) {
        iov->iov_base = static_cast<char*>(iov->iov_base) + w;
        iov->iov_len -= static_cast<size_t>(w);
      }
    }
    return true;
  }
  // Buffered reads for reply lines; bulk payloads go straight into the caller's memory.
  bool Fill() {
    if (pos_ < buf_.size()) return true;
    buf_.resize(4096);
    const ssize_t r = read(fd_, buf_.data(), buf_.size());
    if (r <= 0) return false;
    buf_.resize(static_cast<size_t>(r));
    pos_ = 0;
    return true;
  }
  std::string ReadLine() {
    std::string line;
    while (Fill()) {
      const char c = buf_[pos_++];
      if (c == '\n') {
        if (!line.empty() && line.back() == '\r') line.pop_back();
        return line;
      }
      line.push_back(c);
    }
    return "-ERR connection";
  }
  bool ReadExact(uint8_t* dst, size_t n) {
    const size_t buffered = std::min(n, buf_.size() - pos_);
    std::memcpy(dst, buf_.data() + pos_, buffered);
    pos_ += buffered;
    for (size_t got = buffered; got < n;) {
      const ssize_t r = read(fd_, dst + got, n - got);
      if (r <= 0) return false;
      got += static_cast<size_t>(r);
    }
    return true;
  }

  pid_t pid_ = -1;
  int fd_ = -1;
  std::string buf_;
  size_t pos_ = 0;
};

// ---- the table ------------------------------------------------------------------------------

// CPU time (user + system, seconds) and minor page faults of a process so far, from /proc.
struct ProcUsage {
  double cpu_seconds = 0;
  uint64_t minor_faults = 0;
};
ProcUsage ReadProcUsage(pid_t pid) {
  ProcUsage u;
  FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return u;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  // Fields after the command name (which may hold spaces) start at field 3, the state.
  const char* rest = std::strrchr(buf, ')');
  unsigned long long minflt = 0, utime = 0, stime = 0;
  if (rest != nullptr &&
      std::sscanf(rest + 2, "%*c %*d %*d %*d %*d %*d %*u %llu %*u %*u %*u %llu %llu", &minflt,
                  &utime, &stime) == 3) {
    u.minor_faults = minflt;
    u.cpu_seconds = double(utime + stime) / double(sysconf(_SC_CLK_TCK));
  }
  return u;
}

struct Case {
  Case(std::string n, bool d, std::function<bool()> r, uint64_t b)
      : name(std::move(n)), download(d), run(std::move(r)), bytes(b) {}
  std::string name;
  bool download = false;  // compared with the plain download, else with the plain upload
  std::function<bool()> run;
  std::function<void()> after;  // untimed, after each run (e.g. deleting what it uploaded)
  uint64_t bytes = 0;           // per run (for downloads: what arrived in the warm-up)
  std::vector<double> seconds;
  // Downloads through kvc::Client: when the first layer had arrived whole, from the request
  // (what a decode engine loading layer by layer waits for before it can start), per run.
  std::vector<double> first_layer_seconds;
  std::string note;       // why it has no numbers, or what the server reported
  pid_t server_pid = -1;  // the process serving this case: kvcd, the sink or Redis
  ProcUsage server;       // its CPU time and page faults over the timed runs
  ProcUsage client;       // this process's (the client's; Redis and sink rows: also idle threads)
  bool ok = true;
  // The plain stream rows: the baselines of the ratios.
  bool plain() const { return name.rfind("plain", 0) == 0; }
};

// Warm-up, then `reps` rounds that run every case once in turn, so load from other processes
// on the machine hits all cases alike. Reports each case's median.
void RunRoundRobin(std::list<Case>& cases, int reps) {
  for (Case& c : cases) {
    if (c.ok && !c.run()) {
      c.ok = false;
      c.note = "failed";
    }
    if (c.after) c.after();
  }
  std::vector<Case*> order;
  for (Case& c : cases) order.push_back(&c);
  std::mt19937 rng(1);
  for (int r = 0; r < reps; ++r) {
    // A fresh (seeded) order each round, so no case always follows the same one: a case can run
    // slower right after a heavy one.
    std::shuffle(order.begin(), order.end(), rng);
    for (Case* case_in_order : order) {
      Case& c = *case_in_order;
      if (!c.ok) continue;
      const ProcUsage u0 = ReadProcUsage(c.server_pid), self0 = ReadProcUsage(getpid());
      const absl::Time t0 = absl::Now();
      if (!c.run()) {
        c.ok = false;
        c.note = "failed";
        continue;
      }
      c.seconds.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
      const ProcUsage u1 = ReadProcUsage(c.server_pid), self1 = ReadProcUsage(getpid());
      c.server.cpu_seconds += u1.cpu_seconds - u0.cpu_seconds;
      c.server.minor_faults += u1.minor_faults - u0.minor_faults;
      c.client.cpu_seconds += self1.cpu_seconds - self0.cpu_seconds;
      c.client.minor_faults += self1.minor_faults - self0.minor_faults;
      if (c.after) c.after();
    }
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The ratio to the plain stream is the median over rounds of (case GB/s / plain GB/s) within the
// same round: a round's cases run back to back, so a burst of load from elsewhere on the machine
// mostly scales both sides of a ratio alike.
void Print(const std::list<Case>& cases) {
  const Case* ref[2] = {nullptr, nullptr};
  for (const Case& c : cases) {
    if (c.ok && c.plain()) ref[c.download] = &c;
  }
  auto paired_ratio = [&](const Case& c) {
    const Case* p = ref[c.download];
    if (p == nullptr || p->seconds.size() != c.seconds.size()) return 0.0;
    std::vector<double> r;
    for (size_t i = 0; i < c.seconds.size(); ++i) {
      r.push_back((double(c.bytes) / c.seconds[i]) / (double(p->bytes) / p->seconds[i]));
    }
    return Median(r);
  };
  std::printf("%-40s %9s %9s %8s %9s  %s\n", "case", "MiB/run", "ms/run", "GB/s", "vs plain",
              "notes");
  for (const Case& c : cases) {
    if (!c.ok) {
      std::printf("%-40s %9.1f %9s %8s %9s  %s\n", c.name.c_str(), c.bytes / 1048576.0, "-", "-",
                  "-", c.note.c_str());
      continue;
    }
    const double t = Median(c.seconds), gbps = c.bytes / t / 1e9;
    std::printf("%-40s %9.1f %9.2f %8.3f %8.2fx  %s\n", c.name.c_str(), c.bytes / 1048576.0,
                t * 1e3, gbps, paired_ratio(c), c.note.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // The same malloc behaviour kvcd runs with, for the plain stream and the client alike (this
  // process holds both ends of the plain stream and the kvc client).
  kvc::ReuseLargeMallocs();
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype != "f16" && dtype != "bf16") {
    std::fprintf(stderr, "transport_bench: --dtype=%s is not f16 or bf16\n", dtype.c_str());
    return 2;
  }
  const bool bf16 = dtype == "bf16";
  signal(SIGPIPE, SIG_IGN);
  const std::pair<int, int> sizes[] = {{4096, absl::GetFlag(FLAGS_layers_4k)},
                                       {32768, absl::GetFlag(FLAGS_layers_32k)}};
  auto kv_bytes_of = [](int tokens) { return size_t{8} * tokens * 128 * 2; };  // [8, S, 128] fp16
  uint64_t largest_download = 0;
  for (const auto& [tokens, layers] : sizes) {
    largest_download = std::max<uint64_t>(largest_download,
                                          uint64_t(std::max(layers, 0)) * 2 * kv_bytes_of(tokens));
  }
  int sink_port = 0;
  const pid_t sink_pid = ForkSink(largest_download, &sink_port);
  if (sink_pid < 0 || sink_port == 0) {
    std::fprintf(stderr, "transport_bench: cannot start the plain stream's server\n");
    return 1;
  }
  struct StopSink {
    pid_t pid;
    ~StopSink() {
      kill(pid, SIGTERM);
      waitpid(pid, nullptr, 0);
    }
  } stop_sink{sink_pid};

  kvc::testing::KvcdProcess::Options ko;
  ko.binary = absl::GetFlag(FLAGS_kvcd);
  ko.flags = {"--store_bytes=3GiB", absl::StrCat("--threads=", absl::GetFlag(FLAGS_kvcd_threads)),
              "--max_message_bytes=8MiB", "--max_chunk_bytes=4MiB"};
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_kvcd_flags), ' ', absl::SkipEmpty())) {
    ko.flags.emplace_back(f);
  }
  auto kvcd = kvc::testing::KvcdProcess::Start(ko);
  if (!kvcd.ok()) {
    std::fprintf(stderr, "transport_bench: cannot start kvcd: %s\n",
                 std::string(kvcd.status().message()).c_str());
    return 1;
  }
  kvc::ClientOptions co;
  co.target = (*kvcd)->address();
  co.max_message_bytes = kMaxMessage;
  auto client = kvc::Client::Create(co);
  if (!client.ok()) return 1;
  // The compressing rows depend on the engine's instruction set (AMX scoring or sgemm).
  if (auto info = (*client)->GetServerInfo(); info.ok()) {
    std::printf("kvcd engine: %s\n", info->backend_description().c_str());
  }

  Redis redis;
  absl::Status redis_status = absl::UnavailableError("skipped (--redis empty)");
  if (!absl::GetFlag(FLAGS_redis).empty()) redis_status = redis.Start(absl::GetFlag(FLAGS_redis));

  for (const auto& [tokens, layers] : sizes) {
    if (layers <= 0) continue;  // --layers_4k=0 or --layers_32k=0 skips that size
    const size_t kv_bytes = kv_bytes_of(tokens);
    const size_t q_bytes = size_t{32} * 32 * 128 * 2;  // [32, 32, 128] fp16
    std::vector<uint8_t> k(kv_bytes), v(kv_bytes), q(q_bytes);
    std::mt19937 rng(7);
    std::normal_distribution<float> dist;
    // Random fp16 / bf16 values (bit patterns of N(0,1) samples): incompressible like real
    // activations.
    for (std::vector<uint8_t>* buf : {&k, &v, &q}) {
      for (size_t i = 0; i + 1 < buf->size(); i += 2) {
        const float x = dist(rng);
        const uint16_t h = bf16 ? kvc::FloatToBFloat16(x) : kvc::FloatToHalf(x);
        std::memcpy(buf->data() + i, &h, 2);
      }
    }
    std::vector<kvc::LayerTensors> views(layers, {k.data(), v.data(), q.data()});
    std::vector<std::pair<const uint8_t*, size_t>> tensors;
    for (int l = 0; l < layers; ++l) {
      tensors.push_back({k.data(), kv_bytes});
      tensors.push_back({v.data(), kv_bytes});
      tensors.push_back({q.data(), q_bytes});
    }
    const uint64_t upload = static_cast<uint64_t>(layers) * (2 * kv_bytes + q_bytes);
    const uint64_t kv_total = static_cast<uint64_t>(layers) * 2 * kv_bytes;

    // (a) the plain stream: the sink process, over a channel with the same arguments.
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessage);
    args.SetMaxSendMessageSize(kMaxMessage);
    auto ch = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", sink_port),
                                        grpc::InsecureChannelCredentials(), args);
    grpc::internal::RpcMethod up("/bench.Sink/Upload", grpc::internal::RpcMethod::CLIENT_STREAMING,
                                 ch);
    grpc::internal::RpcMethod down("/bench.Sink/Download",
                                   grpc::internal::RpcMethod::SERVER_STREAMING, ch);
    std::vector<uint8_t> dst(kv_total);

    std::printf(
        "\n== %d tokens x %d layers (Llama-3-8B layer: 8 KV heads, 32 q heads, head_dim "
        "128, %s); upload %.1f MiB per cache, chunks %zu MiB, median of %d ==\n",
        tokens, layers, bf16 ? "bf16" : "fp16", upload / 1048576.0, kChunk >> 20, reps);
    std::list<Case> cases;  // a list: the download cases keep pointers to their own entry
    cases.push_back({"plain gRPC stream upload", false,
                     [&] { return PlainUpload(ch.get(), up, tensors); }, upload});
    int seq = 0;
    pb::PutCacheHeader base;
    base.set_dtype(bf16 ? pb::DTYPE_BF16 : pb::DTYPE_F16);
    base.set_layout(pb::LAYOUT_HND);
    auto* shape = base.mutable_shape();
    shape->set_num_layers(layers);
    shape->set_num_kv_heads(8);
    shape->set_num_q_heads(32);
    shape->set_head_dim(128);
    shape->set_seq_len(tokens);
    shape->set_obs_window(32);
    // Server-side elapsed time per case (header to response), to show where the time goes.
    std::map<std::string, std::vector<double>> server_seconds;
    auto put_case = [&](const std::string& name, const std::string& policy, double ratio) {
      pb::PutCacheHeader h = base;
      h.mutable_compression()->mutable_eviction()->set_policy(policy);
      if (ratio > 0) h.mutable_compression()->mutable_eviction()->set_keep_ratio(ratio);
      cases.push_back({name, false,
                       [&, h, name]() mutable {
                         h.set_cache_id(absl::StrCat("bench-", tokens, "-", seq++));
                         auto r = (*client)->PutCache(h, views);
                         if (!r.ok()) {
                           std::fprintf(stderr, "%s: %s\n", name.c_str(),
                                        r.status().ToString().c_str());
                           return false;
                         }
                         server_seconds[name].push_back(r->elapsed_seconds());
                         return true;
                       },
                       upload});
      // Deleting is a separate request, not part of an upload's time.
      cases.back().after = [&] {
        (void)(*client)->DeleteCache(absl::StrCat("bench-", tokens, "-", seq - 1));
      };
      // The cache the download cases read.
      h.set_cache_id(absl::StrCat("bench-", tokens, "-", policy));
      return (*client)->PutCache(h, views).ok() ? h.cache_id() : std::string();
    };
    // The client library alone: kvc::Client uploading to the discarding sink.
    kvc::ClientOptions sink_options = co;
    sink_options.target = absl::StrCat("127.0.0.1:", sink_port);
    auto sink_client = kvc::Client::Create(sink_options);
    if (!sink_client.ok()) return 1;
    cases.push_back({"kvc Client.PutCache -> discarding sink", false,
                     [&] {
                       pb::PutCacheHeader h = base;
                       h.set_cache_id("sink");
                       return (*sink_client)->PutCache(h, views).ok();
                     },
                     upload});
    const std::string id_none = put_case("kvc PutCache, none", "none", 0);
    const std::string id_snap = put_case("kvc PutCache, snapkv keep 0.25", "snapkv", 0.25);
    put_case("kvc PutCache, keyformer keep 0.25", "keyformer", 0.25);
    // Caches that only the download rows read: every token kept, compressed by `spec`, put once
    // and untimed (their uploads are not rows). The id, or empty when the upload failed.
    auto put_untimed = [&](const std::string& suffix, const auto& spec) {
      pb::PutCacheHeader h = base;
      h.set_cache_id(absl::StrCat("bench-", tokens, "-", suffix));
      h.mutable_compression()->mutable_eviction()->set_policy("none");
      spec(h.mutable_compression());
      return (*client)->PutCache(h, views).ok() ? h.cache_id() : std::string();
    };
    // Kept whole in 4 bits: the downloads of a quantized cache.
    const std::string id_q4 =
        put_untimed("q4", [](pb::CompressionConfig* c) { c->mutable_quant()->set_bits(4); });
    // Half its key channels pruned (ThinK): a DENSE download places the kept channels in full
    // rows.
    const std::string id_think = put_untimed("think", [](pb::CompressionConfig* c) {
      c->mutable_channels()->set_key_policy("think");
      c->mutable_channels()->set_key_lambda(0.5);
    });
    // SnapKV 0.25 with head-adaptive budgets (a 0.2 floor per head): the heads keep different
    // counts, and DENSE pads each to the largest (zero rows, positions -1).
    const std::string id_ada = put_untimed("ada", [](pb::CompressionConfig* c) {
      auto* e = c->mutable_eviction();
      e->set_policy("snapkv");
      e->set_keep_ratio(0.25);
      e->set_adaptive(true);
      e->set_adaptive_floor(0.2);
    });
    cases.push_back({"Redis SET (K, V, Q_obs per layer)", false,
                     [&] {
                       for (size_t t = 0; t < tensors.size(); ++t) {
                         if (!redis.Set(absl::StrCat("bench:", tokens, ":", t), tensors[t].first,
                                        tensors[t].second)) {
                           return false;
                         }
                       }
                       return true;
                     },
                     upload});
    if (!redis_status.ok()) {
      cases.back().ok = false;
      cases.back().note = std::string(redis_status.message());
    }

    cases.push_back({"plain gRPC stream download (K+V)", true,
                     [&] { return PlainDownload(ch.get(), down, kv_total, dst.data()); },
                     kv_total});
    auto get_case = [&](const std::string& name, const std::string& id, kvc::CacheFormat f,
                        bool contiguous = false) {
      Case* c = &cases.emplace_back(name, true, nullptr, 0);
      kvc::GetOptions o;
      o.format = f;
      if (contiguous) {  // the engine-ready export a stock decode engine (vLLM) fetches
        pb::RopeSpec rope;
        rope.set_theta(500000);  // Llama 3's
        rope.set_style(pb::ROPE_HALF_SPLIT);
        o.contiguous_rope = rope;
      }
      c->run = [&, o, id, c] {
        uint64_t got = 0;
        const absl::Time start = absl::Now();
        absl::Status st = (*client)->GetCacheStreaming(id, o, nullptr, [&](kvc::LayerData&& l) {
          if (got == 0) {
            c->first_layer_seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
          }
          got += l.packed.size() + l.k.size() + l.v.size() + 4 * l.positions.size();
          return absl::OkStatus();
        });
        c->bytes = got;
        return st.ok();
      };
      if (id.empty()) {
        c->ok = false;
        c->note = "upload failed";
      }
    };
    get_case("kvc GetCache PACKED, none", id_none, kvc::CacheFormat::kPacked);
    get_case("kvc GetCache DENSE, none", id_none, kvc::CacheFormat::kDense);
    get_case("kvc GetCache PACKED, snapkv keep 0.25", id_snap, kvc::CacheFormat::kPacked);
    get_case("kvc GetCache DENSE, snapkv keep 0.25", id_snap, kvc::CacheFormat::kDense);
    get_case("kvc GetCache DENSE_CONTIGUOUS, snapkv keep 0.25", id_snap, kvc::CacheFormat::kDense,
             /*contiguous=*/true);
    get_case("kvc GetCache PACKED, q4", id_q4, kvc::CacheFormat::kPacked);
    get_case("kvc GetCache DENSE, q4 (dequantized by kvcd)", id_q4, kvc::CacheFormat::kDense);
    get_case("kvc GetCache PACKED, think 0.5", id_think, kvc::CacheFormat::kPacked);
    get_case("kvc GetCache DENSE, think 0.5 (keys scattered by kvcd)", id_think,
             kvc::CacheFormat::kDense);
    get_case("kvc GetCache PACKED, snapkv 0.25 head-adaptive", id_ada, kvc::CacheFormat::kPacked);
    get_case("kvc GetCache DENSE, snapkv 0.25 head-adaptive (padded)", id_ada,
             kvc::CacheFormat::kDense);
    cases.push_back({"Redis GET (K, V per layer)", true,
                     [&] {
                       for (size_t t = 0; t < tensors.size(); ++t) {
                         if (t % 3 == 2) continue;  // decode needs K and V only
                         if (!redis.Get(absl::StrCat("bench:", tokens, ":", t), dst.data(),
                                        tensors[t].second)) {
                           return false;
                         }
                       }
                       return true;
                     },
                     kv_total});
    if (!redis_status.ok()) {
      cases.back().ok = false;
      cases.back().note = std::string(redis_status.message());
    }
    if (const std::string only = absl::GetFlag(FLAGS_only); !only.empty()) {
      std::erase_if(cases, [&](const Case& c) {
        return !c.plain() && c.name.find(only) == std::string::npos;
      });
    }
    for (Case& c : cases) {
      const bool to_sink = c.plain() || c.name.find("sink") != std::string::npos;
      c.server_pid = to_sink                         ? sink_pid
                     : c.name.rfind("Redis", 0) == 0 ? redis.pid()
                                                     : (*kvcd)->pid();
    }
    RunRoundRobin(cases, reps);
    for (Case& c : cases) {
      if (!c.ok) continue;
      // What the server and this process spent per run: CPU time (clock-tick resolution, summed
      // over the runs) and page faults (fresh memory).
      c.note =
          absl::StrFormat("server cpu %.1f ms, %.0f faults; client %.1f ms, %.0f faults",
                          c.server.cpu_seconds / reps * 1e3, double(c.server.minor_faults) / reps,
                          c.client.cpu_seconds / reps * 1e3, double(c.client.minor_faults) / reps);
      if (c.first_layer_seconds.size() > 1) {  // the first one is the warm-up run's
        absl::StrAppendFormat(
            &c.note, "; first layer %.2f ms",
            Median({c.first_layer_seconds.begin() + 1, c.first_layer_seconds.end()}) * 1e3);
      }
      auto it = server_seconds.find(c.name);
      if (it != server_seconds.end() && it->second.size() > 1) {
        // The first one is the warm-up run's.
        absl::StrAppendFormat(&c.note, "; kvcd elapsed %.2f ms",
                              Median({it->second.begin() + 1, it->second.end()}) * 1e3);
      }
    }
    Print(cases);
    if (redis_status.ok()) redis.Command({"FLUSHALL"});
    (void)(*client)->DeleteCache(id_none);
    (void)(*client)->DeleteCache(id_snap);
  }
  return 0;
}
