#include "image/registry/import.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/syscall.hpp"
#include "dsec/error.hpp"
#include "image/build.hpp"
#include "image/fs_tree.hpp"
#include "image/layer_tar.hpp"
#include "image/store/digest.hpp"

namespace dsec::image::registry {
namespace fs = std::filesystem;
namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

double now_unix() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// Removes a scratch directory however the scope ends.
struct ScratchDir {
  fs::path path;
  ~ScratchDir() {
    try {
      remove_tree(path);
    } catch (...) {
    }
  }
};

// The layers of one dsec layer: a single OCI layer, or the merged top of a deep image.
struct LayerGroup {
  std::vector<std::size_t> oci;  // indexes into the manifest's layers, lowest first
  std::string ref;               // oci_layer_ref of their digests
};

std::vector<LayerGroup> group_layers(const ManifestDocument& m, std::size_t max_layers) {
  std::vector<LayerGroup> groups;
  const std::size_t n = m.layers.size();
  const std::size_t singles = n <= max_layers ? n : max_layers - 1;
  for (std::size_t i = 0; i < n; ++i) {
    if (i <= singles) groups.push_back({});  // the last of them, past `singles`, takes every layer above
    groups.back().oci.push_back(i);
  }
  for (auto& g : groups) {
    std::vector<std::string> digests;
    for (std::size_t i : g.oci) digests.push_back(m.layers[i].digest);
    g.ref = oci_layer_ref(digests);
  }
  return groups;
}

LayerRole role_at(std::size_t i, std::size_t n) {
  if (i == 0) return LayerRole::kBase;
  return i + 1 == n ? LayerRole::kTask : LayerRole::kToolchain;
}

// The converted layer a ref names, when the store has it whole.
std::optional<LayerDescriptor> converted(BlobStore& store, const std::string& ref) {
  try {
    ResolvedManifest m = fetch_manifest(store, parse_reference(ref));
    if (m.manifest.layers.size() != 1) return std::nullopt;
    const LayerDescriptor& layer = m.manifest.layers.front();
    // Touched, so that a garbage collection running now keeps them for the image being tagged.
    if (!store.touch_blob(layer.index) || !store.touch_blob(layer.data)) return std::nullopt;
    return layer;
  } catch (const Error& e) {
    if (e.code() == Code::kNotFound || e.code() == Code::kDataLoss) return std::nullopt;
    throw;
  }
}

class Importer {
 public:
  Importer(RegistryClient& client, BlobStore& store, const ImageReference& ref, const ImportOptions& options)
      : client_(client), store_(store), ref_(ref), options_(options) {}

  ImportResult run() {
    const auto started = std::chrono::steady_clock::now();
    if (options_.work_dir.empty()) throw Error(Code::kInvalidArgument, "registry import: no work directory");
    if (options_.max_layers < 2) throw Error(Code::kInvalidArgument, "registry import: max_layers must be 2 or more");
    image_ = client_.fetch_image(ref_, options_.cancelled);
    result_.registry_digest = image_.reference.digest;
    const auto& layers = image_.manifest.layers;
    std::uint64_t total = 0;
    for (const auto& l : layers) total += l.size;
    if (total > options_.max_download)
      throw Error(Code::kResourceExhausted,
                  fmt::format("image {}: its {} layers are {} bytes compressed, more than the {} an import may fetch",
                              ref_.to_string(), layers.size(), total, options_.max_download));
    groups_ = group_layers(image_.manifest, options_.max_layers);
    if (groups_.size() < layers.size())
      result_.notes.push_back(fmt::format("the image's {} layers are stored as {}: its top {} are merged into one",
                                          layers.size(), groups_.size(), groups_.back().oci.size()));
    descriptors_.resize(groups_.size());
    progress_total_ = total;
    convert_all();
    return commit(started);
  }

 private:
  void convert_all() {
    std::atomic<std::size_t> next{0};
    std::vector<std::exception_ptr> errors(groups_.size());
    std::atomic<bool> failed{false};
    auto worker = [&] {
      for (;;) {
        std::size_t i = next.fetch_add(1);
        if (i >= groups_.size()) return;
        if (failed.load()) return;
        try {
          descriptors_[i] = layer(i);
        } catch (...) {
          errors[i] = std::current_exception();
          failed = true;
        }
      }
    };
    const unsigned n = std::max(1u, std::min<unsigned>(options_.parallel, static_cast<unsigned>(groups_.size())));
    std::vector<std::thread> threads;
    for (unsigned t = 1; t < n; ++t) threads.emplace_back(worker);
    worker();
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

  bool cancelled() const { return options_.cancelled && options_.cancelled(); }

  // The dsec layer of group i: found in the store, or converted (once per store: the claim).
  LayerDescriptor layer(std::size_t i) {
    const LayerGroup& g = groups_[i];
    if (auto found = converted(store_, g.ref)) {
      note_reused(g);
      return *found;
    }
    auto claim = store_.claim(g.ref);
    if (auto found = converted(store_, g.ref)) {  // converted by whoever held the claim
      note_reused(g);
      return *found;
    }
    if (cancelled()) throw Error(Code::kCancelled, "the import was cancelled");
    LayerDescriptor d = convert(i);
    std::lock_guard lock(mu_);
    ++result_.layers_converted;
    return d;
  }

  void note_reused(const LayerGroup& g) {
    std::lock_guard lock(mu_);
    ++result_.layers_reused;
    for (std::size_t i : g.oci) progress_done_ += image_.manifest.layers[i].size;
    report(fmt::format("layer {} (stored before)", g.ref));
  }

  void report(const std::string& what) {
    if (options_.progress) options_.progress(what, progress_done_, progress_total_);
  }

  LayerDescriptor convert(std::size_t i) {
    const LayerGroup& g = groups_[i];
    ScratchDir work{make_scratch_dir(options_.work_dir, "oci-layer-")};
    const fs::path tree = work.path / "tree";
    // Syscalls, not std::filesystem's throwing calls: a full disk is RESOURCE_EXHAUSTED, never an unnamed exception.
    if (::mkdir(tree.c_str(), 0755) != 0) throw_errno_fmt(errno, "registry import: mkdir {}", tree.string());
    std::vector<std::string> notes;
    TarLimits limits;
    limits.max_bytes = options_.max_bytes;
    for (std::size_t k : g.oci) {
      const Descriptor& blob = image_.manifest.layers[k];
      const fs::path file = work.path / "blob";
      std::uint64_t counted = 0;
      auto progress = [&](std::uint64_t bytes) {
        std::lock_guard lock(mu_);
        progress_done_ += bytes - counted;
        counted = bytes;
        report(fmt::format("layer {}/{} {}", k + 1, image_.manifest.layers.size(), blob.digest.substr(0, 19)));
      };
      auto started = std::chrono::steady_clock::now();
      std::uint64_t got = client_.download_blob(image_.reference, blob, file, progress, options_.cancelled);
      {
        std::lock_guard lock(mu_);
        result_.bytes_downloaded += got;
        result_.seconds_download += seconds_since(started);
      }
      started = std::chrono::steady_clock::now();
      try {
        apply_layer_tar(file, tree, WhiteoutMode::kOverlay, limits, notes);
      } catch (const Error& e) {
        // A layer that is not a readable tar is the registry's fault (never dsec's data): not DATA_LOSS.
        const Code code = e.code() == Code::kDataLoss ? Code::kFailedPrecondition : e.code();
        throw Error(code, fmt::format("image {}: layer {} ({}): {}", ref_.to_string(), k + 1, blob.digest, e.what()));
      }
      ::unlink(file.c_str());  // the tree has it now; scratch space goes back at once
      {
        std::lock_guard lock(mu_);
        result_.seconds_unpack += seconds_since(started);
      }
      if (cancelled()) throw Error(Code::kCancelled, "the import was cancelled");
    }
    const auto storing = std::chrono::steady_clock::now();
    LayerDescriptor d = store_tree_as_layer(store_, tree, role_at(i, groups_.size()), work.path, notes);
    // The converted layer's own one-layer manifest, tagged by the OCI digest(s): found again by the next image.
    ImageReference layer_ref = parse_reference(g.ref);
    Manifest m;
    m.name = layer_ref.name;
    m.tag = layer_ref.tag;
    m.layers = {d};
    m.created_at = now_unix();
    m.source = fmt::format("registry {} layer{} {}", image_.reference.name, g.oci.size() == 1 ? "" : "s",
                           fmt::join(oci_digests(g), ","));
    m.notes = notes;
    commit_manifest(store_, m);
    std::lock_guard lock(mu_);
    result_.seconds_store += seconds_since(storing);
    for (const auto& n : notes) result_.notes.push_back(n);
    if (options_.log) options_.log(fmt::format("stored layer {} as {}", g.ref, d.digest));
    return d;
  }

  std::vector<std::string> oci_digests(const LayerGroup& g) const {
    std::vector<std::string> out;
    for (std::size_t k : g.oci) out.push_back(image_.manifest.layers[k].digest);
    return out;
  }

  ImportResult commit(std::chrono::steady_clock::time_point started) {
    Manifest m;
    ImageReference tag = import_tag(ref_);
    m.name = tag.name;
    m.tag = tag.tag;
    for (std::size_t i = 0; i < descriptors_.size(); ++i) {
      LayerDescriptor d = descriptors_[i];
      d.role = role_at(i, descriptors_.size());
      m.layers.push_back(std::move(d));
    }
    m.created_at = now_unix();
    m.source = image_.source();
    if (image_.manifest_digest != image_.reference.digest)
      m.notes.push_back(fmt::format("{} image {}", client_.options().platform.to_string(), image_.manifest_digest));
    for (const auto& n : result_.notes) m.notes.push_back(n);
    m.config = image_.config.config;
    tag.digest = commit_manifest(store_, m);
    result_.image = fetch_manifest(store_, tag);
    result_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    return std::move(result_);
  }

  RegistryClient& client_;
  BlobStore& store_;
  const ImageReference ref_;
  const ImportOptions& options_;
  RegistryImage image_;
  std::vector<LayerGroup> groups_;
  std::vector<LayerDescriptor> descriptors_;
  std::mutex mu_;
  ImportResult result_;
  std::uint64_t progress_done_ = 0, progress_total_ = 0;
};

}  // namespace

std::string oci_layer_ref(const std::vector<std::string>& oci_digests) {
  if (oci_digests.size() == 1) return fmt::format("oci-layer/sha256:{}", digest_hex(oci_digests.front(), "layer"));
  std::string joined;
  for (const auto& d : oci_digests) joined += d + "\n";
  return fmt::format("oci-layers/sha256:{}", digest_hex(sha256_digest(joined)));
}

ImageReference import_tag(const ImageReference& ref) {
  ImageReference out = ref;
  out.digest.clear();
  if (!ref.digest.empty()) out.tag = "sha256-" + digest_hex(ref.digest);
  return out;
}

std::string registry_digest_of(const Manifest& m) {
  if (!m.source.starts_with("registry ")) return {};
  auto at = m.source.rfind('@');
  if (at == std::string::npos) return {};
  std::string d = m.source.substr(at + 1);
  return is_digest(d) ? d : std::string();
}

ImportResult import_image(RegistryClient& client, BlobStore& store, const ImageReference& ref,
                          const ImportOptions& options) {
  return Importer(client, store, ref, options).run();
}

}  // namespace dsec::image::registry
