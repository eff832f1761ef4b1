// The PutCache uploads in flight, by store id, so that something other than the upload's own
// stream can stop it: DeleteCache of its cache id (the client no longer wants it) and shutdown
// (compressions still running after the drain are abandoned). Stopping an upload cancels its
// compression (kvc/cancel.h: the engine stops at its next row block) and ends its stream with the
// given status at once, whatever its compression jobs are doing.
//
// Thread-safety: every method may be called from any thread. The stop functions run without the
// table's lock held, and may run after Remove returned (a stop already under way completes): they
// must stay safe to call once their stream is gone.
#ifndef KVC_SERVICE_SERVER_UPLOAD_TABLE_H_
#define KVC_SERVICE_SERVER_UPLOAD_TABLE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace kvc::server {

class UploadTable {
 public:
  using StopFn = std::function<void(const absl::Status& why)>;

  // Registers an upload of `store_id`; `stop` ends it. Returns a key for Remove.
  uint64_t Add(const std::string& store_id, StopFn stop);
  void Remove(uint64_t key);
  // Stops every upload of `store_id` and removes it from the table at once (its stream may end a
  // moment later: a second Stop of the id, e.g. a second DeleteCache, finds nothing); returns how
  // many there were.
  int Stop(const std::string& store_id, const absl::Status& why);
  // Stops every upload; returns how many there were.
  int StopAll(const absl::Status& why);
  int size() const;

 private:
  struct Upload {
    std::string store_id;
    StopFn stop;
  };
  mutable absl::Mutex mu_;
  uint64_t next_key_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Upload> uploads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_UPLOAD_TABLE_H_
