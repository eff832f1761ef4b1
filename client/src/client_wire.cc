#include "kvc/client_wire.h"

#include <algorithm>
#include <utility>

namespace kvc {

std::vector<ChunkSpan> SplitChunks(uint64_t total, uint64_t max_chunk) {
  std::vector<ChunkSpan> chunks;
  if (max_chunk == 0) return chunks;
  chunks.reserve(static_cast<size_t>((total + max_chunk - 1) / max_chunk));
  for (uint64_t off = 0; off < total; off += max_chunk) {
    chunks.push_back({off, std::min(max_chunk, total - off)});
  }
  return chunks;
}

grpc::ByteBuffer FramePutChunk(const kvcache::v1::ChunkHeader& chunk, const void* data,
                               size_t size, std::shared_ptr<const void> keepalive) {
  kvcache::v1::PutCacheRequest req;
  *req.mutable_chunk() = chunk;
  return FrameWithData(req, data, size, std::move(keepalive));
}

}  // namespace kvc
