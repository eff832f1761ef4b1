#include "src/layer_assembler.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvc/checked_math.h"

namespace kvc {
namespace {
namespace pb = kvcache::v1;
}  // namespace

LayerAssembler::LayerAssembler(const CacheInfo& info, CacheFormat format, uint32_t begin,
                               uint32_t end)
    : info_(info), format_(format), begin_(begin) {
  end_ = end == 0 ? info.shape().num_layers() : end;
  elem_size_ = info.dtype() == pb::DTYPE_F32 ? 4 : 2;
}

absl::Status LayerAssembler::Add(const pb::LayerChunk& chunk, const RawData& data,
                                 const std::function<absl::Status(LayerData&&)>& on_layer) {
  const uint32_t l = chunk.layer();
  if (l < begin_ || l >= end_) {
    return absl::InternalError(absl::StrCat("GetCache stream: chunk for layer ", l,
                                            " outside the requested [", begin_, ", ", end_, ")"));
  }
  if (done_.count(l) > 0) {
    return absl::InternalError(absl::StrCat("GetCache stream: layer ", l, " sent twice"));
  }
  int index = -1;
  if (format_ == CacheFormat::kPacked) {
    if (chunk.part() == pb::PART_PACKED) index = 0;
  } else {
    if (chunk.part() == pb::PART_K) index = 0;
    if (chunk.part() == pb::PART_V) index = 1;
    if (chunk.part() == pb::PART_POSITIONS) index = 2;
  }
  if (index < 0) {
    return absl::InternalError(
        absl::StrCat("GetCache stream: unexpected part ", chunk.part(), " for layer ", l));
  }
  Pending& p = pending_[l];
  Part& part = p.parts[index];
  LayerData& d = p.data;
  const uint64_t total = chunk.total_bytes();
  if (!part.started) {
    // The size of each part follows from the CacheInfo; never trust a bare total_bytes.
    const uint64_t kept = chunk.kept_tokens();
    const uint64_t heads = info_.shape().num_kv_heads();
    uint64_t expected = 0;
    if (format_ == CacheFormat::kDense) {
      if (kept == 0 || kept > info_.shape().seq_len()) {
        return absl::InternalError(absl::StrCat("GetCache stream: layer ", l, " kept_tokens ", kept,
                                                " outside [1, seq_len]"));
      }
      // Checked: a CacheInfo with absurd fields must not wrap into a plausible size.
      const std::optional<uint64_t> want =
          index == 2 ? CheckedProduct({heads, kept, 4})
                     : CheckedProduct({heads, kept, info_.shape().head_dim(), elem_size_});
      if (!want) {
        return absl::InternalError(absl::StrCat(
            "GetCache stream: layer ", l, " part ", chunk.part(), ": num_kv_heads*kept_tokens*",
            index == 2 ? "4" : "head_dim*dtype_bytes", " overflows 64 bits"));
      }
      expected = *want;
      if (total != expected) {
        return absl::InternalError(absl::StrCat("GetCache stream: layer ", l, " part ",
                                                chunk.part(), " total_bytes ", total,
                                                " != expected ", expected));
      }
    } else if (info_.stored_bytes() > 0 && total > info_.stored_bytes()) {
      return absl::InternalError(absl::StrCat("GetCache stream: layer ", l, " total_bytes ", total,
                                              " exceeds stored_bytes ", info_.stored_bytes()));
    }
    if (d.kept_tokens != 0 && d.kept_tokens != kept) {
      return absl::InternalError(
          absl::StrCat("GetCache stream: layer ", l, " kept_tokens changed mid-layer"));
    }
    d.layer = l;
    d.kept_tokens = static_cast<uint32_t>(kept);
    part.started = true;
    part.total = total;
    // Byte parts are reserved, not resized: in-order chunks are appended, so the destination is
    // written once by the copy instead of being zero-filled first.
    if (format_ == CacheFormat::kPacked) {
      d.packed.reserve(total);
    } else if (index == 0) {
      d.k.reserve(total);
    } else if (index == 1) {
      d.v.reserve(total);
    } else {
      d.positions.resize(total / 4);
    }
  }
  if (total != part.total || chunk.offset() > total || data.size() > total - chunk.offset() ||
      part.received + data.size() > total) {
    return absl::InternalError(absl::StrCat("GetCache stream: layer ", l, " chunk at offset ",
                                            chunk.offset(), " of ", data.size(),
                                            " bytes does not fit part of ", part.total));
  }
  if (index == 2) {
    data.CopyTo(reinterpret_cast<uint8_t*>(d.positions.data()) + chunk.offset());
  } else {
    ByteVector& dst = format_ == CacheFormat::kPacked ? d.packed : index == 0 ? d.k : d.v;
    const size_t end = static_cast<size_t>(chunk.offset() + data.size());
    if (chunk.offset() == dst.size()) {
      data.AppendTo(&dst);
    } else {  // out of order: grow to cover the chunk (zero-filling any gap), copy in place
      if (dst.size() < end) dst.resize(end);
      data.CopyTo(dst.data() + chunk.offset());
    }
  }
  part.received += data.size();

  const int nparts = format_ == CacheFormat::kPacked ? 1 : 3;
  for (int i = 0; i < nparts; ++i) {
    if (!p.parts[i].started || p.parts[i].received != p.parts[i].total) return absl::OkStatus();
  }
  // Byte counts add up; a part shorter than its total means chunks overlapped and left a hole.
  const bool holes = format_ == CacheFormat::kPacked
                         ? d.packed.size() != p.parts[0].total
                         : d.k.size() != p.parts[0].total || d.v.size() != p.parts[1].total;
  if (holes) {
    return absl::InternalError(absl::StrCat("GetCache stream: layer ", l, " chunks overlap"));
  }
  if (format_ == CacheFormat::kDense) {
    // Head-adaptive layers pad each head to kept_tokens with position -1: a head's real rows are
    // its leading non-negative positions.
    const size_t heads = info_.shape().num_kv_heads();
    d.counts.assign(heads, 0);
    for (size_t h = 0; h < heads; ++h) {
      const int32_t* pos = d.positions.data() + h * d.kept_tokens;
      uint32_t n = 0;
      while (n < d.kept_tokens && pos[n] >= 0) ++n;
      for (uint32_t i = n; i < d.kept_tokens; ++i) {
        if (pos[i] != -1) {
          return absl::InternalError(absl::StrCat("GetCache stream: layer ", l, " head ", h,
                                                  " has position ", pos[i], " after padding"));
        }
      }
      d.counts[h] = n;
    }
  }
  LayerData complete = std::move(d);
  pending_.erase(l);
  done_[l] = true;
  ++delivered_;
  return on_layer(std::move(complete));
}

absl::Status LayerAssembler::Finish() const {
  if (delivered_ != end_ - begin_) {
    return absl::DataLossError(
        absl::StrCat("GetCache stream ended after ", delivered_, " of ", end_ - begin_, " layers"));
  }
  return absl::OkStatus();
}

}  // namespace kvc
