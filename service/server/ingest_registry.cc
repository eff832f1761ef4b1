#include "server/ingest_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/convert.h"

namespace kvc::server {
namespace {

int TensorIndex(kvcache::v1::TensorKind t) {
  switch (t) {
    case kvcache::v1::TENSOR_K:
      return 0;
    case kvcache::v1::TENSOR_V:
      return 1;
    case kvcache::v1::TENSOR_Q_OBS:
      return 2;
    case kvcache::v1::TENSOR_Q_STATS:
      return 3;
    default:
      return -1;
  }
}

constexpr const char* kTensorNames[4] = {"K", "V", "Q_obs", "Q_stats"};

}  // namespace

IngestRegistry::Entry::Entry(std::shared_ptr<Upload> upload,
                             const kvcache::v1::PutCacheHeader& header, uint64_t max_chunk_bytes)
    : upload_(std::move(upload)), max_chunk_bytes_(std::max<uint64_t>(max_chunk_bytes, 1)) {
  // The sizes the upload accepted with its header (Upload::OnHeader): the proto is mapped once.
  for (int t = 0; t < 4; ++t) tensor_bytes_[t] = upload_->tensor_bytes(t);
  num_layers_ = static_cast<uint32_t>(upload_->num_layers());
}

absl::Status IngestRegistry::Entry::Close() {
  absl::MutexLock lock(&mu_);
  open_ = false;
  return error_;
}

uint64_t IngestRegistry::Entry::delivered_bytes() const {
  absl::MutexLock lock(&mu_);
  return delivered_;
}

absl::StatusOr<std::shared_ptr<IngestRegistry::Entry>> IngestRegistry::Register(
    const std::string& store_id, std::shared_ptr<Upload> upload,
    const kvcache::v1::PutCacheHeader& header, uint64_t max_chunk_bytes,
    std::function<void()> on_delivery) {
  absl::MutexLock lock(&mu_);
  if (entries_.count(store_id) > 0) {
    return absl::AbortedError(absl::StrCat("header.cache_id: '", header.cache_id(),
                                           "' is being uploaded with external_payload on another "
                                           "stream"));
  }
  std::shared_ptr<Entry> e(new Entry(std::move(upload), header, max_chunk_bytes));
  e->on_delivery_ = std::move(on_delivery);
  entries_[store_id] = e;
  return e;
}

void IngestRegistry::Unregister(const std::string& store_id, const std::shared_ptr<Entry>& entry) {
  if (entry == nullptr) return;
  entry->Close().IgnoreError();
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(store_id);
  if (it != entries_.end() && it->second == entry) entries_.erase(it);
}

absl::Status IngestRegistry::Deliver(const std::string& store_id, uint32_t layer,
                                     kvcache::v1::TensorKind tensor,
                                     absl::Span<const uint8_t> bytes) {
  std::shared_ptr<Entry> e;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(store_id);
    if (it != entries_.end()) e = it->second;
  }
  auto not_found = [&] {
    return absl::NotFoundError(absl::StrCat(
        "cache_id: no PutCache stream with external_payload is open for '", store_id, "'"));
  };
  if (e == nullptr) return not_found();
  absl::MutexLock lock(&e->mu_);
  if (!e->open_) return not_found();
  if (!e->error_.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("cache_id: the upload of '", store_id,
                                                      "' already failed: ", e->error_.message()));
  }
  absl::Status s;
  const int t = TensorIndex(tensor);
  if (t >= 0 && layer < e->num_layers_ && bytes.size() != e->tensor_bytes_[t]) {
    s = absl::InvalidArgumentError(absl::StrCat("num_bytes: layer ", layer, " tensor ",
                                                kTensorNames[t], " is ", e->tensor_bytes_[t],
                                                " bytes, got ", bytes.size()));
  }
  // The whole tensor goes through the Upload's chunk path at offset 0 (in pieces of at most
  // max_chunk_bytes), so it gets exactly the validation and placement of streamed chunks. An
  // empty tensor still makes one call so that a bad layer or kind is reported.
  uint64_t offset = 0;
  do {
    if (!s.ok()) break;
    const uint64_t n = std::min<uint64_t>(bytes.size() - offset, e->max_chunk_bytes_);
    RawPutRequest req;
    req.kind = RawPutRequest::Kind::kChunk;
    req.chunk.set_layer(layer);
    req.chunk.set_tensor(tensor);
    req.chunk.set_offset(offset);
    if (n > 0) req.data.push_back({bytes.data() + offset, static_cast<size_t>(n)});
    req.data_size = static_cast<size_t>(n);
    s = e->upload_->OnChunk(req);
    offset += n;
  } while (offset < bytes.size());
  if (!s.ok()) {
    // The upload fails as a whole: nothing of it may be stored, and its stream reports this.
    e->error_ = s;
    e->upload_->Abort();
    return s;
  }
  e->delivered_ += bytes.size();
  if (e->on_delivery_) e->on_delivery_();
  return absl::OkStatus();
}

int IngestRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(entries_.size());
}

absl::Status TransferIngestSink::Consume(const transfer::TensorHeader& header,
                                         absl::Span<const uint8_t> bytes) {
  return registry_->Deliver(header.cache_id, header.layer, header.tensor, bytes);
}

}  // namespace kvc::server
