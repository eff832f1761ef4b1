// The client's side of the raw framing of the bulk messages: chunking and framing of upload
// chunks. Parsing (RawData, ParseRawMessage) and the framing primitives are shared with kvcd and
// declared in kvc/protocol/wire.h, included here. Public so tests and tools can use it; most users
// want kvc/client.h instead.
//
// Thread-safety: pure functions.
#ifndef KVC_CLIENT_WIRE_H_
#define KVC_CLIENT_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kvc/bytes.h"
#include "kvc/protocol/wire.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc {

// How a tensor of `total` bytes is cut into chunks of at most `max_chunk` bytes (max_chunk > 0):
// consecutive, in order, each max_chunk long except possibly the last. total == 0 gives none.
struct ChunkSpan {
  uint64_t offset = 0;
  uint64_t size = 0;
};
std::vector<ChunkSpan> SplitChunks(uint64_t total, uint64_t max_chunk);

// A PutCacheRequest carrying `chunk` and the `size` bytes at `data` as its data field. The bytes
// are not copied: `data` must stay valid until gRPC's transport has released the message, which
// can be after Write() and Finish() return (a write still being flushed when the stream broke).
// With `keepalive`, the message's slice holds a copy of it until that release, so a caller can
// wait for the last copy to go before it frees `data`.
grpc::ByteBuffer FramePutChunk(const kvcache::v1::ChunkHeader& chunk, const void* data,
                               size_t size, std::shared_ptr<const void> keepalive = nullptr);

}  // namespace kvc

#endif  // KVC_CLIENT_WIRE_H_
