// Reassembles GetCache's chunk stream into whole layers, checking every chunk against the
// CacheInfo that opened the stream so a faulty server cannot make the client write out of bounds
// or allocate unbounded memory. Not thread-safe (one per stream).
#ifndef KVC_CLIENT_SRC_LAYER_ASSEMBLER_H_
#define KVC_CLIENT_SRC_LAYER_ASSEMBLER_H_

#include <cstdint>
#include <functional>
#include <map>

#include "absl/status/status.h"
#include "kvc/client.h"
#include "kvc/client_wire.h"

namespace kvc {

class LayerAssembler {
 public:
  // `info` is the stream's first message; layers [begin, end) are expected (end 0 = all).
  LayerAssembler(const CacheInfo& info, CacheFormat format, uint32_t begin, uint32_t end);

  // Adds one chunk; calls `on_layer` when it completes a layer. Errors: INTERNAL for a chunk
  // that contradicts the stream (wrong layer, part, sizes, overlap), or the callback's status.
  absl::Status Add(const kvcache::v1::LayerChunk& chunk, const RawData& data,
                   const std::function<absl::Status(LayerData&&)>& on_layer);

  // DATA_LOSS unless every expected layer was delivered.
  absl::Status Finish() const;

 private:
  struct Part {
    bool started = false;
    uint64_t total = 0;
    uint64_t received = 0;
  };
  struct Pending {
    LayerData data;
    Part parts[3];  // PACKED uses [0]; DENSE: K, V, POSITIONS
  };

  CacheInfo info_;
  CacheFormat format_;
  uint32_t begin_ = 0;
  uint32_t end_ = 0;
  uint32_t delivered_ = 0;
  uint64_t elem_size_ = 2;
  std::map<uint32_t, Pending> pending_;
  std::map<uint32_t, bool> done_;
};

}  // namespace kvc

#endif  // KVC_CLIENT_SRC_LAYER_ASSEMBLER_H_
