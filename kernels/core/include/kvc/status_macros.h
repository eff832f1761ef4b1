// Error-propagation macros for absl::Status / absl::StatusOr (the Abseil in Debian 12 predates its
// own). Usage:
//   RETURN_IF_ERROR(DoThing());
//   ASSIGN_OR_RETURN(auto value, MakeThing());
#ifndef KVC_STATUS_MACROS_H_
#define KVC_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KVC_STATUS_CONCAT_INNER_(a, b) a##b
#define KVC_STATUS_CONCAT_(a, b) KVC_STATUS_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                   \
  do {                                          \
    ::absl::Status kvc_status_ = (expr);        \
    if (!kvc_status_.ok()) return kvc_status_;  \
  } while (0)

#define KVC_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()

#define ASSIGN_OR_RETURN(lhs, expr) \
  KVC_ASSIGN_OR_RETURN_IMPL_(KVC_STATUS_CONCAT_(kvc_statusor_, __LINE__), lhs, expr)

#endif  // KVC_STATUS_MACROS_H_
