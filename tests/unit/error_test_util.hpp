// What unit tests share to check which error a call throws.
#pragma once

#include <functional>

#include "dsec/error.hpp"

namespace dsec::test {

// The code of the dsec::Error fn() throws; Code::kOk when it throws none.
inline Code code_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.code();
  }
  return Code::kOk;
}

}  // namespace dsec::test
