// Tests of what survives a crashed agent drop an object as its dying owner would: abandon(std::move(p)) never runs
// its destructor (so none of its clean-up happens), and keeps it reachable, so LeakSanitizer does not report it.
#pragma once

#include <memory>
#include <vector>

namespace dsec::test {

template <typename T>
void abandon(std::unique_ptr<T> object) {
  static auto* kept = new std::vector<const void*>();
  kept->push_back(object.release());
}

}  // namespace dsec::test
