// Registry images on first use (docs/images.md): a create that names an image of an OCI registry the node's stores
// lack imports it into the node's store (image/registry/import.hpp) and goes on with it. However many creates of one
// image arrive at once, it is imported once: the first starts the import in the background and every create waits
// for it, each up to its own limit; one that gives up leaves the import running for the next. Imported tags are
// asked of the registry again after `tag_ttl` (a moved tag is imported again; a registry that cannot be reached
// then leaves the stored image in use); a reference pinned by digest never is.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "image/registry/import.hpp"
#include "image/registry/registry_client.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"

namespace dsec::agent {

struct RegistryImportOptions {
  image::registry::RegistryOptions registry;
  // Where bare names ("python:3.12") come from when no store has them; empty: nowhere (they are store images only).
  std::string default_registry;
  std::chrono::seconds tag_ttl{60};
  // The longest a create waits for an import (the import itself goes on).
  std::chrono::seconds wait{600};
  std::filesystem::path work_dir;  // scratch space of imports
  std::uint64_t max_bytes = 64ull << 30;
  std::size_t max_layers = 32;
};

class RegistryImports {
 public:
  // Imports go to `target` (a store the node may write); lookups go through `stores` (target among them).
  RegistryImports(RegistryImportOptions options, image::BlobStore& target, std::vector<image::BlobStore*> stores);
  ~RegistryImports();  // cancels running imports and waits for them
  RegistryImports(const RegistryImports&) = delete;
  RegistryImports& operator=(const RegistryImports&) = delete;

  // Whether `ref` is this class's business: it names a registry, or a default registry is set.
  bool handles(const image::ImageReference& ref) const;
  // The stored image `ref` names, imported first when the stores lack it (or its tag moved). NOT_FOUND,
  // UNAUTHENTICATED, ... as the registry client and the import say; DEADLINE_EXCEEDED when the import outlasts the
  // wait (it goes on).
  image::ResolvedManifest resolve(const image::ImageReference& ref);

  struct Stats {
    std::uint64_t imports = 0, failed = 0, layers_converted = 0, layers_reused = 0, bytes_downloaded = 0;
  };
  Stats stats() const;

 private:
  struct Import;
  std::optional<image::ResolvedManifest> stored(const image::ImageReference& ref);
  image::ResolvedManifest import(const image::ImageReference& ref);
  bool checked_lately(const std::string& tagged);
  void mark_checked(const std::string& tagged);

  RegistryImportOptions options_;
  image::BlobStore& target_;
  std::vector<image::BlobStore*> stores_;
  image::registry::RegistryClient client_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Import>> running_;  // by reference
  std::list<std::pair<std::thread, std::shared_ptr<Import>>> threads_;
  std::map<std::string, std::chrono::steady_clock::time_point> checked_;  // registry tags, when last asked
  Stats stats_;
};

}  // namespace dsec::agent
