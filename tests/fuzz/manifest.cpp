// Fuzz target: what a node reads from an image store it does not control: image manifests (the client also sends
// one with every create) and chunk indexes (image/store/manifest.hpp, chunk_index.hpp), image references, and chunk
// data decoded against an index; and what an OCI registry answers: image manifests, indexes and image
// configurations (image/registry/oci_image.hpp).
//
// Input: text up to the first NUL is given to every parser; what follows the NUL is a data blob, whose chunks are
// decoded against the text when it is a valid chunk index.
//
// Properties: bad input is dsec::Error INVALID_ARGUMENT (DATA_LOSS for chunk bytes that do not match), nothing else;
// a registry's document that parses keeps its promises (sha256 digests, sizes within bounds, known layer types, an
// index's pick is one of its entries);
// a manifest or an index that parses writes out as JSON that parses to the same text again; a reference that parses
// prints as one that parses to the same; escape_reference is undone by unescape_reference.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "dsec/error.hpp"
#include "fuzz_util.hpp"
#include "image/registry/oci_image.hpp"
#include "image/store/chunk_index.hpp"
#include "image/store/digest.hpp"
#include "image/store/manifest.hpp"

namespace {

using dsec::Code;
using dsec::Error;
namespace image = dsec::image;

void manifest(std::string_view text) {
  std::string json;
  try {
    json = image::manifest_to_json(image::manifest_from_json(text));
  } catch (const Error& e) {
    fuzz::expect_code(e, Code::kInvalidArgument, "manifest_from_json");
    return;
  }
  std::string again;
  try {
    again = image::manifest_to_json(image::manifest_from_json(json));
  } catch (const Error& e) {
    fuzz::fail(std::string("manifest_from_json refused its own output ") + json + ": " + e.what());
  }
  if (again != json) fuzz::fail("manifest: to_json(from_json(x)) is not stable: " + json + " then " + again);
}

void chunk_index(std::string_view text, std::string_view blob) {
  image::ChunkIndex index;
  try {
    index = image::chunk_index_from_json(text);
  } catch (const Error& e) {
    fuzz::expect_code(e, Code::kInvalidArgument, "chunk_index_from_json");
    return;
  }
  std::string json = image::chunk_index_to_json(index);
  std::string again;
  try {
    again = image::chunk_index_to_json(image::chunk_index_from_json(json));
  } catch (const Error& e) {
    fuzz::fail(std::string("chunk_index_from_json refused its own output ") + json + ": " + e.what());
  }
  if (again != json) fuzz::fail("chunk index: to_json(from_json(x)) is not stable: " + json + " then " + again);

  // The index's promises, which the layer cache relies on: chunks cover the layer exactly and lie in the data blob.
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < index.chunk_count(); ++i) {
    const auto& c = index.chunks[i];
    if (c.length == 0 || c.offset + c.length > index.data_size)
      fuzz::fail("chunk index: a chunk outside the data blob");
    std::uint32_t length = index.chunk_length(i);
    if (length == 0 || length > index.chunk_size) fuzz::fail("chunk index: a chunk of no bytes or too many");
    covered += length;
  }
  if (covered != index.size) fuzz::fail("chunk index: the chunks do not cover the layer's size");
  for (std::uint32_t n : index.prefetch)
    if (n >= index.chunk_count()) fuzz::fail("chunk index: prefetch names a chunk that does not exist");

  // Decode the chunks the blob holds (a node verifies every chunk it fetches this way).
  std::string out;
  for (std::size_t i = 0; i < index.chunk_count() && i < 8; ++i) {
    const auto& c = index.chunks[i];
    if (c.offset > blob.size()) continue;
    if (index.chunk_length(i) > (4u << 20)) continue;  // bounded memory per input
    try {
      image::decode_chunk(index, i, blob.substr(c.offset, c.length), out);
      if (out.size() != index.chunk_length(i)) fuzz::fail("decode_chunk: wrong length accepted");
    } catch (const Error& e) {
      fuzz::expect_code(e, Code::kDataLoss, "decode_chunk");
    }
  }
}

void reference(std::string_view text) {
  image::ImageReference ref;
  try {
    ref = image::parse_reference(text);
  } catch (const Error& e) {
    fuzz::expect_code(e, Code::kInvalidArgument, "parse_reference");
    return;
  }
  image::ImageReference again;
  try {
    again = image::parse_reference(ref.to_string());
  } catch (const Error& e) {
    fuzz::fail("parse_reference refused its own to_string " + ref.to_string() + ": " + e.what());
  }
  if (again.name != ref.name || again.tag != ref.tag || again.digest != ref.digest)
    fuzz::fail("parse_reference: to_string does not parse back to the same reference: " + ref.to_string());
  if (image::unescape_reference(image::escape_reference(ref.tagged())) != ref.tagged())
    fuzz::fail("unescape_reference(escape_reference(x)) != x for " + ref.tagged());
  if (image::escape_reference(ref.tagged()).find_first_of("/:") != std::string::npos)
    fuzz::fail("escape_reference left a '/' or ':' in " + ref.tagged());
}

void registry_documents(std::string_view text) {
  namespace reg = dsec::image::registry;
  try {
    reg::ManifestDocument doc = reg::parse_manifest(text, "application/vnd.oci.image.manifest.v1+json");
    auto sane = [](const reg::Descriptor& d) { return image::is_digest(d.digest) && d.size <= (1ull << 40); };
    for (const auto& d : doc.manifests)
      if (!sane(d)) fuzz::fail("parse_manifest: an index entry with a bad digest or size");
    for (const auto& d : doc.layers)
      if (!sane(d)) fuzz::fail("parse_manifest: a layer with a bad digest or size");
    if (doc.is_index) {
      reg::platforms_of(doc);
      if (auto picked = reg::pick_platform(doc, reg::parse_platform("linux/amd64")))
        if (!picked->platform || picked->platform->architecture != "amd64")
          fuzz::fail("pick_platform: picked an entry of another platform");
    } else if (doc.layers.empty() || !sane(doc.config)) {
      fuzz::fail("parse_manifest: an image manifest without layers or with a bad config descriptor");
    }
  } catch (const Error& e) {
    fuzz::expect_code(e, Code::kInvalidArgument, "parse_manifest");
  }
  try {
    reg::ImageConfigDocument config = reg::parse_image_config(text);
    for (const auto& e : config.config.env)
      if (e.empty() || e.front() == '=' || e.find('=') == std::string::npos) fuzz::fail("parse_image_config: bad Env");
    if (!config.config.working_dir.empty() && config.config.working_dir.front() != '/')
      fuzz::fail("parse_image_config: a relative WorkingDir");
  } catch (const Error& e) {
    fuzz::expect_code(e, Code::kInvalidArgument, "parse_image_config");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Input in(data, size);
  std::string_view text = in.until('\0');
  std::string_view blob = in.rest();
  manifest(text);
  chunk_index(text, blob);
  reference(text);
  registry_documents(text);
  std::string raw(text);
  if (image::unescape_reference(image::escape_reference(raw)) != raw)
    fuzz::fail("unescape_reference(escape_reference(x)) != x");
  return 0;
}
