// dsecd's log: one line per event on stderr, "dsecd <level>: <message>". The agent logs what an operator needs to
// see (startup, shutdown, sandboxes it had to clean up, failures nobody asked about); request errors go to the client.
#pragma once

#include <cstdio>
#include <string_view>

#include <fmt/format.h>

namespace dsec::agent {

template <typename... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  fmt::print(stderr, "dsecd: {}\n", fmt::format(f, std::forward<Args>(args)...));
}

template <typename... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  fmt::print(stderr, "dsecd warning: {}\n", fmt::format(f, std::forward<Args>(args)...));
}

template <typename... Args>
void log_error(fmt::format_string<Args...> f, Args&&... args) {
  fmt::print(stderr, "dsecd error: {}\n", fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace dsec::agent
