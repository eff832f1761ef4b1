#include "server/upload_table.h"

#include <utility>
#include <vector>

namespace kvc::server {

uint64_t UploadTable::Add(const std::string& store_id, StopFn stop) {
  absl::MutexLock lock(&mu_);
  const uint64_t key = next_key_++;
  uploads_.emplace(key, Upload{store_id, std::move(stop)});
  return key;
}

void UploadTable::Remove(uint64_t key) {
  absl::MutexLock lock(&mu_);
  uploads_.erase(key);
}

int UploadTable::Stop(const std::string& store_id, const absl::Status& why) {
  std::vector<StopFn> stops;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = uploads_.begin(); it != uploads_.end();) {
      if (it->second.store_id == store_id) {
        stops.push_back(std::move(it->second.stop));
        it = uploads_.erase(it);  // stopped: no longer in flight, whenever its stream is done
      } else {
        ++it;
      }
    }
  }
  for (const StopFn& stop : stops) stop(why);
  return static_cast<int>(stops.size());
}

int UploadTable::StopAll(const absl::Status& why) {
  std::vector<StopFn> stops;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, u] : uploads_) stops.push_back(u.stop);
  }
  for (const StopFn& stop : stops) stop(why);
  return static_cast<int>(stops.size());
}

int UploadTable::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(uploads_.size());
}

}  // namespace kvc::server
