// kvcctl soak: the expected-content model. A Version is one upload's content, derived from a seed
// (shape, dtype, layout, compression, tensor values) together with what kvcd must serve for it:
// the engine's own compact blobs (kvc::Backend::Compress on the client's CPU backend, which is
// deterministic and bit-identical to kvcd's). A Ledger records, per cache id, the uploads,
// deletes and kvcd restarts with a logical clock, and answers which versions a GetCache may
// legally return; Verify checks fetched bytes against them, so that a torn, mixed or corrupted
// result is reported with the layer, part and byte where it differs.
//
// Thread-safety: a Version is immutable after MakeVersion; a Ledger is thread-safe.
#ifndef KVC_CLIENT_KVCCTL_SOAK_MODEL_H_
#define KVC_CLIENT_KVCCTL_SOAK_MODEL_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvc/backend.h"
#include "kvc/client.h"
#include "kvc/spec.h"

namespace kvc::soak {

// Bounds of the random shapes (small: a soak runs many of them).
struct ShapeLimits {
  int max_layers = 3;
  int max_kv_heads = 4;
  int max_tokens = 384;
  int max_head_dim = 128;  // D is drawn from {32, 64, 128} up to this
  // Only versions stored as is (policy none, no pruning, no quantization): for a kvcd whose
  // backend is not the CPU engine, whose compressed bytes need not equal the CPU engine's.
  bool lossless_only = false;
};

struct Version {
  std::string id;
  uint64_t seed = 0;
  kvcache::v1::PutCacheHeader header;  // cache_id, shape, dtype, layout, compression, overwrite
  CompressionSpec spec;                // what kvcd maps header.compression to
  DType dtype = DType::kF16;
  Layout layout = Layout::kHND;
  LayerShape shape;
  int num_layers = 0;
  // True when kvcd must store the input as is (policy none, no pruning, no quantization): then
  // served bytes are also compared with the input itself, independently of the engine.
  bool lossless = false;
  // The tensors sent, per layer, in `layout`. Kept for as long as the version lives only when
  // lossless (MakeVersion's caller holds them for the upload otherwise), so that a long soak
  // with many ids does not hold every input.
  struct Input {
    std::vector<std::vector<uint8_t>> k, v, q;
    std::vector<LayerTensors> Tensors() const;
  };
  std::shared_ptr<const Input> input;  // null unless lossless
  std::vector<ByteVector> packed;      // per layer: the engine's blob
  uint64_t checksum = 0;               // CacheInfo.checksum of `packed`
  uint64_t kv_bytes = 0;               // K + V bytes sent (PutCacheResponse.input_bytes)
  // "snapkv keep=0.25 think=0.5 bits=4 f16 NHD L3 Hkv2 Hq4 S200 D64 W16 seed=..."
  std::string Describe() const;
};

// A version and the tensors to upload for it.
struct Upload {
  std::shared_ptr<const Version> version;
  std::shared_ptr<const Version::Input> input;
};

// Draws a version for `id` from `seed` and computes its expected blobs with `backend`.
absl::StatusOr<Upload> MakeVersion(const std::string& id, uint64_t seed, const ShapeLimits& limits,
                                   Backend& backend);

// CacheInfo.checksum of a cache whose layers are `blobs` (layer l = blobs[l]).
uint64_t CacheChecksum(const std::vector<ByteVector>& blobs);

// Checks a cache fetched with `opt` against one version: the info (shape, dtype, policy,
// checksum), the layer list (exactly opt's range when `complete`, else a prefix of it, as after a
// cancelled download), the checksum of the received blobs on a whole PACKED fetch, then every byte
// of every layer (PACKED: the engine's blob, and for lossless versions the input rows; DENSE:
// ExportDense of the blob, and for lossless versions the input in HND). DATA_LOSS names the first
// difference.
absl::Status Verify(const Version& version, const CacheData& got, const GetOptions& opt,
                    bool complete);

// Bytes compared by a successful Verify (for the summary).
uint64_t VerifiedBytes(const CacheData& got);

// Per-id history of operations on a logical clock. An operation occupies [start, end] ticks
// (Tick() before the RPC is sent, after it returns). A GetCache over [gs, ge] may return version
// p when p's upload started before ge and no successful upload of another version, delete or
// restart both began after p's upload ended and ended before gs. NOT_FOUND is always legal (the
// store evicts under pressure).
class Ledger {
 public:
  uint64_t Tick() { return clock_.fetch_add(1) + 1; }

  // Returns a handle for EndPut.
  uint64_t BeginPut(std::shared_ptr<const Version> version, uint64_t start);
  // `maybe_stored` false when the status proves nothing was stored (INVALID_ARGUMENT,
  // RESOURCE_EXHAUSTED, ALREADY_EXISTS, a cancelled partial upload).
  void EndPut(const std::string& id, uint64_t handle, bool ok, bool maybe_stored, uint64_t end);
  // A successful DeleteCache (or one answering NOT_FOUND: either way the id is empty after it).
  void Deleted(const std::string& id, uint64_t start, uint64_t end);
  // kvcd was killed at tick `at`: every id is empty from then on.
  void Wiped(uint64_t at);

  // A GetCache brackets its RPC with BeginGet (returns its start tick) and EndGet, so that no
  // version it may legally see is forgotten while it runs.
  uint64_t BeginGet();
  void EndGet(uint64_t start);
  std::vector<std::shared_ptr<const Version>> Candidates(const std::string& id, uint64_t get_start,
                                                         uint64_t get_end) const;

  size_t RecordsForTesting() const;

 private:
  static constexpr uint64_t kOpen = ~uint64_t{0};
  struct Record {
    uint64_t handle = 0;
    std::shared_ptr<const Version> version;  // null for a delete
    uint64_t start = 0, end = kOpen;
    bool ok = false;           // completed successfully (delete: always)
    bool maybe_stored = true;  // uploads only
  };
  // True when `r` (an upload) is superseded by a successful record that ended before `before`.
  static bool Superseded(const Record& r, const std::vector<Record>& history,
                         const std::vector<uint64_t>& wipes, uint64_t before);
  void PruneLocked(std::vector<Record>& history, uint64_t now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::atomic<uint64_t> clock_{0};
  mutable absl::Mutex mu_;
  std::map<std::string, std::vector<Record>> ids_ ABSL_GUARDED_BY(mu_);
  uint64_t next_handle_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<uint64_t> wipes_ ABSL_GUARDED_BY(mu_);
  std::multiset<uint64_t> active_gets_ ABSL_GUARDED_BY(mu_);
};

// Picks the candidate `got` matches. DATA_LOSS when none does, listing for each candidate where it
// differs (and, when different layers match different candidates, saying so: a mix).
absl::StatusOr<std::shared_ptr<const Version>> Match(
    const std::vector<std::shared_ptr<const Version>>& candidates, const CacheData& got,
    const GetOptions& opt, bool complete);

}  // namespace kvc::soak

#endif  // KVC_CLIENT_KVCCTL_SOAK_MODEL_H_
