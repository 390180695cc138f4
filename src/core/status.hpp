// Internal error type: a status code and a message naming the argument and the rule.
#pragma once
#include <string>
#include <utility>

#include "flashport/flashport.h"

namespace flashport {

class Status {
 public:
  Status() = default;
  Status(fp_status code, std::string msg) : code_(code), msg_(std::move(msg)) {}
  static Status ok() { return {}; }
  bool is_ok() const { return code_ == FP_OK; }
  explicit operator bool() const { return is_ok(); }
  fp_status code() const { return code_; }
  const std::string& message() const { return msg_; }

 private:
  fp_status code_ = FP_OK;
  std::string msg_;
};

inline Status invalid(std::string msg) { return {FP_ERR_INVALID_ARGUMENT, std::move(msg)}; }
inline Status unsupported(std::string msg) { return {FP_ERR_UNSUPPORTED, std::move(msg)}; }

#define FP_RETURN_IF_ERROR(expr)            \
  do {                                      \
    ::flashport::Status _fp_st = (expr);    \
    if (!_fp_st.is_ok()) return _fp_st;     \
  } while (0)

}  // namespace flashport
