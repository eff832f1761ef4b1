// Every kvcctl flag, defined once with Abseil's flag library (as kvcd's are). Each subcommand
// accepts the subset it names with FlagSet::Use (flags.h); defaults and help live only here.
#include <cstdint>
#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051",
          "kvcd address: host:port, a comma-separated list, or dns:///name:port");
ABSL_FLAG(double, timeout, 0, "seconds per call; 0 = the client's defaults (10 s, 300 s streams)");
ABSL_FLAG(std::string, token, "", "bearer token sent as 'authorization: Bearer <token>'");
ABSL_FLAG(int64_t, chunk_mib, 4, "largest upload chunk in MiB, 1..4");
ABSL_FLAG(bool, tls, false, "connect with TLS (implied by --tls_ca, --tls_cert, --tls_key)");
ABSL_FLAG(std::string, tls_ca, "", "PEM roots that verify kvcd; empty = the system roots");
ABSL_FLAG(std::string, tls_cert, "", "PEM client certificate for mutual TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
// The policies' names are listed under the flags from kvc/policy.h (FlagSet::Help).
ABSL_FLAG(std::string, policy, "none",
          "token eviction policy, listed below (put: expected needs --rope_pairs)");
ABSL_FLAG(std::string, value_weight, "",
          "value-aware scores for h2o, snapkv, keyformer, expected, kvzip: auto (mul for expected), off, "
          "mul, add");
ABSL_FLAG(double, value_eps, -1, "value weighting floor, >= 0; -1 = server default (0.02)");
ABSL_FLAG(int64_t, horizon, 0,
          "expected: query statistics rotated to the next N positions; 0 = server default (1)");
ABSL_FLAG(double, ratio, 0, "fraction of tokens kept per KV head, (0, 1]; 0 = unset");
ABSL_FLAG(int64_t, budget, 0, "tokens kept per KV head (wins over --ratio); 0 = unset");
ABSL_FLAG(std::string, key_policy, "",
          "key channel pruning: none, think, l1, l2 "
          "(default think when --lambda > 0)");
ABSL_FLAG(double, lambda, 0, "fraction of key channels pruned, [0, 1)");
ABSL_FLAG(int64_t, bits, 0, "quantization bits: 0 (off), 2, 4, 8");
ABSL_FLAG(int64_t, recent, -1, "recent tokens kept unpruned and unquantized; -1 = server default");
ABSL_FLAG(int64_t, seed, 0, "noise seed (keyformer, random)");
ABSL_FLAG(double, ada, -1,
          "head-adaptive budgets (AdaKV) with per-head floor ALPHA in [0, 1] (each head keeps its "
          "top ALPHA * budget, the rest of the layer's budget goes to the best heads); -1 = off");
ABSL_FLAG(bool, xlayer, false,
          "layer-adaptive budgets (with --ada): the cache's layers * heads * budget tokens go "
          "where the scores are highest over all layers (kvcd on the cpu backend)");
ABSL_FLAG(std::string, id, "", "cache id (default: the file name without directory and extension)");
ABSL_FLAG(int64_t, ttl, 0, "seconds until the cache expires; 0 = the server's default");
ABSL_FLAG(bool, overwrite, false, "replace an existing cache with the same id");
ABSL_FLAG(std::string, format, "packed",
          "GetCache format: packed (compact blobs), dense (K, V, positions) or contiguous "
          "(dense with keys re-rotated for slots 0..K-1; get only, needs the --rope_* flags)");
ABSL_FLAG(int64_t, layer_begin, 0, "first layer");
ABSL_FLAG(int64_t, layer_end, -1, "one past the last layer; -1 = all");
ABSL_FLAG(std::string, prefix, "", "only ids starting with this");
ABSL_FLAG(int64_t, concurrency, 4, "concurrent workers (threads), 1..256");
ABSL_FLAG(int64_t, requests, 0, "total iterations over all workers; 0 = bounded by --duration");
ABSL_FLAG(double, duration, 0, "seconds to run; 0 = bounded by --requests");
ABSL_FLAG(std::string, mode, "both", "both (put, get, delete per iteration), put, or get");
ABSL_FLAG(int64_t, layers, 4, "layers per cache");
ABSL_FLAG(int64_t, kv_heads, 8, "KV heads");
ABSL_FLAG(int64_t, q_heads, 32, "query heads (a multiple of --kv_heads)");
ABSL_FLAG(int64_t, head_dim, 128, "head dimension");
ABSL_FLAG(int64_t, tokens, 4096, "prompt tokens per cache");
ABSL_FLAG(int64_t, window, 32, "observation queries per layer");
ABSL_FLAG(std::string, dtype, "f16", "f16, bf16 or f32");
ABSL_FLAG(std::string, id_prefix, "bench", "cache ids are <prefix>-<pid>-<worker>-<n>");
ABSL_FLAG(double, rope_theta, 10000,
          "--format=contiguous, put: the RoPE base the keys were stored with");
ABSL_FLAG(std::string, rope_pairs, "",
          "--format=contiguous (required), put (sends the RoPE; needed by --policy=expected): "
          "interleaved (pairs 2i, 2i+1: llama2.c, Meta) or half_split (pairs i, i+d/2: Hugging "
          "Face Llama)");
ABSL_FLAG(int64_t, rope_dims, 0, "--format=contiguous: rotated channels; 0 = head_dim");
ABSL_FLAG(double, rope_linear, 0, "--format=contiguous: linear RoPE scaling factor; 0 = none");

// soak (soak.cc). It also takes --target, --timeout, --duration, --id_prefix and --seed, with
// its own defaults when they are not given (120 s, 60 s, "soak/", 1).
ABSL_FLAG(std::string, kvcd, "",
          "soak: kvcd binary to run on a loopback port (and SIGKILL/restart with --kill_every); "
          "empty = soak --target, which is never killed");
ABSL_FLAG(std::string, kvcd_flags, "--threads=2 --backend=cpu",
          "soak: extra kvcd flags, space-separated (with --kvcd)");
ABSL_FLAG(std::string, kvcd_log, "", "soak: kvcd output file; default $TMPDIR/kvcctl-soak-<pid>.log");
ABSL_FLAG(int64_t, store_mib, 64, "soak: kvcd --store_bytes in MiB (with --kvcd; else the target's)");
ABSL_FLAG(int64_t, buffer_pool_mib, 32,
          "soak: kvcd --buffer_pool_bytes in MiB (with --kvcd; else the target's)");
ABSL_FLAG(int64_t, clients, 8, "soak: concurrent clients (threads, each with its own channels), 1..256");
ABSL_FLAG(double, kill_every, 0, "soak: seconds between SIGKILL+restart of kvcd; 0 = never");
ABSL_FLAG(double, fault_rate, 0.15,
          "soak: share of iterations that inject a client fault (cancelled or stalled upload, "
          "cancelled download, tiny deadline), [0, 1]");
ABSL_FLAG(double, stall_seconds, 3,
          "soak: how long a stalled upload waits before cancelling; 0 = no stalls");
ABSL_FLAG(int64_t, tiny_deadline_ms, 20,
          "soak: the longest tiny deadline (clients cycle 0.2 ms, 1 ms, 5 ms, this)");
ABSL_FLAG(int64_t, race_ids, 4, "soak: cache ids shared by all clients (overwrite/delete races)");
ABSL_FLAG(int64_t, max_layers, 3, "soak: random shapes: most layers");
ABSL_FLAG(int64_t, max_kv_heads, 4, "soak: random shapes: most KV heads (1, 2 or 4)");
ABSL_FLAG(int64_t, max_tokens, 384, "soak: random shapes: longest prompt (>= 16)");
ABSL_FLAG(int64_t, max_head_dim, 128, "soak: random shapes: largest head_dim (32, 64 or 128)");
ABSL_FLAG(double, recover_seconds, 30,
          "soak: a client still UNAVAILABLE this long after kvcd restarted is a failure");
ABSL_FLAG(std::string, rss_csv, "", "soak: write kvcd's RSS samples here (seconds,pid,rss,hwm,ops)");
ABSL_FLAG(int64_t, rss_overhead_mib, 128,
          "soak: fixed part of the RSS bound (binary, threads, arenas)");
ABSL_FLAG(int64_t, rss_bound_mib, 0, "soak: RSS bound in MiB; 0 = the formula (see --help)");
ABSL_FLAG(int64_t, kvcd_pid, 0, "soak: with --target, sample this process's RSS (0 = none)");
ABSL_FLAG(std::string, metrics, "",
          "soak: with --target, its metrics host:port for the end checks (with --kvcd: found)");
ABSL_FLAG(bool, self_check, false,
          "soak: flip one byte of the 1st, 11th, 21st... fetched cache before verifying it: the "
          "run must then FAIL with CORRUPTION (proves the verifier sees a bad byte)");
ABSL_FLAG(bool, verbose, false, "soak: print a progress line every 5 s");
