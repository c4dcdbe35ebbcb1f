// The image store: digests, references, manifests, chunk indexes, chunked layers, the directory store and the
// catalog (resolve, commit, copy between stores, garbage collection).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "dsec/error.hpp"
#include "image/image_test_util.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/chunk_index.hpp"
#include "image/store/digest.hpp"
#include "image/store/manifest.hpp"

namespace dsec::image {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::compressible_bytes;
using testing::expect_error;
using testing::random_bytes;
using testing::read_text;
using testing::TempDir;
using testing::write_text;

constexpr const char* kEmptySha = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr const char* kAbcSha = "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

std::string fake_digest(char c) { return "sha256:" + std::string(64, c); }

// ---------------------------------------------------------------------------------------------------------------
// Digests

TEST(ImageDigest, KnownValuesIncrementalAndFile) {
  EXPECT_EQ(sha256_digest(""), kEmptySha);
  EXPECT_EQ(sha256_digest("abc"), kAbcSha);
  Sha256 h;
  h.update("a");
  h.update("");
  h.update("bc");
  EXPECT_EQ(h.finish(), kAbcSha);

  TempDir tmp;
  std::string big = random_bytes(3 << 20 | 17);
  write_text(tmp / "big", big);
  write_text(tmp / "empty", "");
  EXPECT_EQ(sha256_file(tmp / "big"), sha256_digest(big));
  EXPECT_EQ(sha256_file(tmp / "empty"), kEmptySha);
  expect_error([&] { sha256_file(tmp / "missing"); }, Code::kNotFound, {"missing"});
}

TEST(ImageDigest, IsDigestAndDigestHex) {
  EXPECT_TRUE(is_digest(kAbcSha));
  EXPECT_TRUE(is_digest(fake_digest('0')));
  EXPECT_FALSE(is_digest(""));
  EXPECT_FALSE(is_digest("sha256:"));
  EXPECT_FALSE(is_digest(std::string(kAbcSha).substr(0, 70)));      // 63 hex digits
  EXPECT_FALSE(is_digest(std::string(kAbcSha) + "0"));              // 65
  EXPECT_FALSE(is_digest("sha256:" + std::string(64, 'A')));        // uppercase
  EXPECT_FALSE(is_digest("sha256:" + std::string(63, 'a') + "g"));  // not hex
  EXPECT_FALSE(is_digest("sha512:" + std::string(64, 'a')));
  EXPECT_FALSE(is_digest("SHA256:" + std::string(64, 'a')));
  EXPECT_FALSE(is_digest(" sha256:" + std::string(63, 'a')));

  EXPECT_EQ(digest_hex(kAbcSha), std::string(kAbcSha).substr(7));
  expect_error([] { digest_hex("sha256:xyz", "layer digest"); }, Code::kInvalidArgument,
               {"layer digest", "sha256:xyz"});
  expect_error([] { digest_hex(""); }, Code::kInvalidArgument, {"digest"});
}

// ---------------------------------------------------------------------------------------------------------------
// References

TEST(ImageReference, ParsesTagsAndPinnedDigests) {
  ImageReference r = parse_reference("busybox");
  EXPECT_EQ(r.name, "busybox");
  EXPECT_EQ(r.tag, "latest");
  EXPECT_EQ(r.digest, "");
  EXPECT_EQ(r.tagged(), "busybox:latest");
  EXPECT_EQ(r.to_string(), "busybox:latest");

  r = parse_reference("busybox:1.36");
  EXPECT_EQ(r.name, "busybox");
  EXPECT_EQ(r.tag, "1.36");

  r = parse_reference("swe/task-17:latest");
  EXPECT_EQ(r.name, "swe/task-17");
  EXPECT_EQ(r.tag, "latest");

  r = parse_reference(std::string("swe/task-17@") + kAbcSha);
  EXPECT_EQ(r.name, "swe/task-17");
  EXPECT_EQ(r.tag, "latest");
  EXPECT_EQ(r.digest, kAbcSha);
  EXPECT_EQ(r.to_string(), std::string("swe/task-17:latest@") + kAbcSha);

  r = parse_reference(std::string("a.b/c_d/e-f:_v2.0-rc1@") + kAbcSha);
  EXPECT_EQ(r.name, "a.b/c_d/e-f");
  EXPECT_EQ(r.tag, "_v2.0-rc1");
  EXPECT_EQ(r.digest, kAbcSha);

  // The longest name and tag allowed.
  std::string name255 = "a" + std::string(254, 'b');
  std::string tag128 = "t" + std::string(127, '1');
  r = parse_reference(name255 + ":" + tag128);
  EXPECT_EQ(r.name, name255);
  EXPECT_EQ(r.tag, tag128);
}

TEST(ImageReference, RefusesBadNamesSayingWhy) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "empty"},
      {"Bad Name", "a space"},
      {":tag", "no name"},
      {"name:", "empty tag"},
      {"a//b", "empty part"},
      {"/a", "empty part"},
      {"a/", "empty part"},
      {"-a", "must start with a letter or digit"},
      {"a/.b", "must start with a letter or digit"},
      {"a:b:c", "more than one ':'"},
      {"a@sha256:xyz", "sha256 digest"},
      {"a@", "sha256 digest"},
      {"a:.tag", "the tag must start"},
      {"a:-x", "the tag must start"},
      {"a:t/ag", "port 't'"},  // "a:t" is a registry host with a port, as Docker reads it
      {"a\x01", "byte 0x01"},
      {"a$b", "'$'"},
      {"a" + std::string(255, 'b'), "longer than 255"},
      {"a:" + std::string(129, 't'), "longer than 128"},
      {"../etc", "must start with a letter or digit"},
  };
  for (const auto& [text, why] : bad) {
    SCOPED_TRACE(text);
    expect_error([&] { parse_reference(text); }, Code::kInvalidArgument, {"invalid image name", why});
  }
}

TEST(ImageReference, EscapeIsOnePathComponentAndRoundTrips) {
  EXPECT_EQ(escape_reference("swe/task-17:latest"), "swe%2Ftask-17%3Alatest");
  for (std::string s : {"busybox:latest", "swe/task-17:latest", "a/b/c:_1.0", "odd%2Fname:%", "%%:%3A", ""}) {
    std::string e = escape_reference(s);
    EXPECT_EQ(e.find('/'), std::string::npos) << e;
    EXPECT_EQ(e.find(':'), std::string::npos) << e;
    EXPECT_EQ(unescape_reference(e), s) << e;
  }
  EXPECT_EQ(unescape_reference("a%2fb%3ac"), "a/b:c");  // lowercase hex too
  EXPECT_EQ(unescape_reference("100%"), "100%");        // a lone '%' stays
  EXPECT_EQ(unescape_reference("%41"), "%41");          // only the three escapes are decoded
}

// ---------------------------------------------------------------------------------------------------------------
// Manifests

Manifest sample_manifest() {
  Manifest m;
  m.name = "swe/task-17";
  m.tag = "v1";
  m.created_at = 1747750000.5;
  m.source = "tar /srv/task-17.tar.gz";
  m.parent = std::string("py:dev@") + kAbcSha;
  m.notes = {"skipped dev/null", "a note with \"quotes\" and \n newline"};
  LayerDescriptor base;
  base.role = LayerRole::kBase;
  base.digest = fake_digest('1');
  base.size = 123456789;
  base.index = fake_digest('2');
  base.data = fake_digest('3');
  base.stored_size = 4567890;
  base.files_size = 99999999;
  LayerDescriptor task = base;
  task.role = LayerRole::kTask;
  task.digest = fake_digest('4');
  task.size = 4096;
  task.index = fake_digest('5');
  task.data = fake_digest('6');
  task.stored_size = 100;
  task.files_size = 0;
  m.layers = {base, task};
  return m;
}

TEST(ImageManifest, JsonRoundTripIsCanonical) {
  Manifest m = sample_manifest();
  std::string text = manifest_to_json(m);
  // Canonical: sorted keys and no whitespace, so parsing and dumping again gives the same bytes.
  EXPECT_EQ(json::parse(text).dump(), text);
  EXPECT_EQ(text.find("\n"), std::string::npos);
  Manifest back = manifest_from_json(text);
  EXPECT_EQ(back.name, m.name);
  EXPECT_EQ(back.tag, m.tag);
  EXPECT_EQ(back.created_at, m.created_at);
  EXPECT_EQ(back.source, m.source);
  EXPECT_EQ(back.parent, m.parent);
  EXPECT_EQ(back.notes, m.notes);
  ASSERT_EQ(back.layers.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back.layers[i].role, m.layers[i].role);
    EXPECT_EQ(back.layers[i].digest, m.layers[i].digest);
    EXPECT_EQ(back.layers[i].size, m.layers[i].size);
    EXPECT_EQ(back.layers[i].index, m.layers[i].index);
    EXPECT_EQ(back.layers[i].data, m.layers[i].data);
    EXPECT_EQ(back.layers[i].stored_size, m.layers[i].stored_size);
    EXPECT_EQ(back.layers[i].files_size, m.layers[i].files_size);
  }
  EXPECT_EQ(manifest_to_json(back), text);
  EXPECT_EQ(back.size(), 123456789u + 4096u);
  EXPECT_EQ(back.stored_size(), 4567890u + 100u);
  EXPECT_EQ(back.reference(), "swe/task-17:v1");

  for (LayerRole role : {LayerRole::kBase, LayerRole::kToolchain, LayerRole::kTask, LayerRole::kSnapshot})
    EXPECT_EQ(parse_layer_role(to_string(role)), role);
  expect_error([] { parse_layer_role("Base"); }, Code::kInvalidArgument, {"Base"});
}

TEST(ImageManifest, EachMalformedFieldIsNamed) {
  const json good = json::parse(manifest_to_json(sample_manifest()));
  struct Case {
    std::string field;  // what the message must name
    std::function<void(json&)> damage;
  };
  const std::vector<Case> cases = {
      {"schema", [](json& j) { j.erase("schema"); }},
      {"schema", [](json& j) { j["schema"] = 3; }},
      {"schema", [](json& j) { j["schema"] = "1"; }},
      {"name", [](json& j) { j.erase("name"); }},
      {"name", [](json& j) { j["name"] = 17; }},
      {"name", [](json& j) { j["name"] = "Bad Name"; }},
      {"name", [](json& j) { j["name"] = "a:b"; }},
      {"name", [](json& j) { j["name"] = ""; }},
      {"tag", [](json& j) { j.erase("tag"); }},
      {"tag", [](json& j) { j["tag"] = "-x"; }},
      {"tag", [](json& j) { j["tag"] = std::string("v1@") + kAbcSha; }},
      {"layers", [](json& j) { j.erase("layers"); }},
      {"layers", [](json& j) { j["layers"] = json::array(); }},
      {"layers", [](json& j) { j["layers"] = "sha256"; }},
      {"layers",
       [](json& j) {
         json many = json::array();
         for (int i = 0; i < 65; ++i) many.push_back(j["layers"][0]);
         j["layers"] = many;
       }},
      {"layers[1]", [](json& j) { j["layers"][1] = 5; }},
      {"layers[0].role", [](json& j) { j["layers"][0]["role"] = "root"; }},
      {"layers[0].role", [](json& j) { j["layers"][0].erase("role"); }},
      {"layers[1].digest", [](json& j) { j["layers"][1]["digest"] = "sha256:1234"; }},
      {"layers[1].digest", [](json& j) { j["layers"][1].erase("digest"); }},
      {"layers[0].size", [](json& j) { j["layers"][0]["size"] = 0; }},
      {"layers[0].size", [](json& j) { j["layers"][0]["size"] = -5; }},
      {"layers[0].size", [](json& j) { j["layers"][0]["size"] = "12"; }},
      {"layers[0].index", [](json& j) { j["layers"][0]["index"] = fake_digest('X'); }},
      {"layers[0].data", [](json& j) { j["layers"][0]["data"] = nullptr; }},
      {"layers[1].stored_size", [](json& j) { j["layers"][1].erase("stored_size"); }},
      {"layers[1].files_size", [](json& j) { j["layers"][1]["files_size"] = "lots"; }},
      {"notes",
       [](json& j) {
         j["notes"] = json::array({1, 2});
       }},
      {"notes", [](json& j) { j["notes"] = "one note"; }},
      {"created_at", [](json& j) { j["created_at"] = "yesterday"; }},
      {"source", [](json& j) { j["source"] = 12; }},
      {"parent", [](json& j) { j["parent"] = json::array(); }},
  };
  for (const Case& c : cases) {
    json j = good;
    c.damage(j);
    SCOPED_TRACE(j.dump().substr(0, 300));
    expect_error([&] { manifest_from_json(j.dump()); }, Code::kInvalidArgument, {"manifest", c.field});
  }
  expect_error([] { manifest_from_json("{\"schema\":1,"); }, Code::kInvalidArgument, {"not JSON"});
  expect_error([] { manifest_from_json("[]"); }, Code::kInvalidArgument, {"object"});
  expect_error([] { manifest_from_json(""); }, Code::kInvalidArgument, {"manifest"});
}

// ---------------------------------------------------------------------------------------------------------------
// Chunk indexes

ChunkIndex sample_index() {
  ChunkIndex index;
  index.layer = fake_digest('a');
  index.chunk_size = 4096;
  index.size = 3 * 4096 + 100;
  index.meta_size = 8192;
  index.data = fake_digest('b');
  index.data_size = 10000;
  index.chunks = {{0, 4096, std::string(64, '1')},
                  {4096, 1000, std::string(64, '2')},
                  {5096, 3000, std::string(64, '3')},
                  {8096, 100, std::string(64, '4')}};
  index.prefetch = {0, 1};
  return index;
}

TEST(ImageChunkIndex, JsonRoundTrip) {
  ChunkIndex index = sample_index();
  std::string text = chunk_index_to_json(index);
  EXPECT_EQ(json::parse(text).dump(), text);
  ChunkIndex back = chunk_index_from_json(text);
  EXPECT_EQ(back.layer, index.layer);
  EXPECT_EQ(back.size, index.size);
  EXPECT_EQ(back.meta_size, index.meta_size);
  EXPECT_EQ(back.chunk_size, index.chunk_size);
  EXPECT_EQ(back.data, index.data);
  EXPECT_EQ(back.data_size, index.data_size);
  EXPECT_EQ(back.prefetch, index.prefetch);
  ASSERT_EQ(back.chunk_count(), 4u);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(back.chunks[i].offset, index.chunks[i].offset);
    EXPECT_EQ(back.chunks[i].length, index.chunks[i].length);
    EXPECT_EQ(back.chunks[i].sha256_hex, index.chunks[i].sha256_hex);
  }
  EXPECT_EQ(chunk_index_to_json(back), text);
  EXPECT_EQ(back.chunk_length(0), 4096u);
  EXPECT_EQ(back.chunk_length(3), 100u);
  EXPECT_EQ(back.chunk_length(4), 0u);
  EXPECT_EQ(back.chunk_of(0), 0u);
  EXPECT_EQ(back.chunk_of(4095), 0u);
  EXPECT_EQ(back.chunk_of(4096), 1u);
  EXPECT_EQ(back.chunk_of(3 * 4096 + 99), 3u);
}

TEST(ImageChunkIndex, RefusesInconsistentIndexes) {
  const json good = json::parse(chunk_index_to_json(sample_index()));
  struct Case {
    std::string field;
    std::function<void(json&)> damage;
  };
  const std::vector<Case> cases = {
      // The chunk count must match the size: one chunk too many, one too few.
      {"chunks", [](json& j) { j["size"] = 3 * 4096; }},
      {"chunks", [](json& j) { j["size"] = 4 * 4096 + 1; }},
      {"chunks", [](json& j) { j["chunks"].erase(3); }},
      {"chunks", [](json& j) { j["chunks"] = "none"; }},
      {"chunks[2]",
       [](json& j) {
         j["chunks"][2] = json::array({5096, 3000});
       }},
      {"chunks[2]", [](json& j) { j["chunks"][2][2] = "xyz"; }},
      {"chunks[3]", [](json& j) { j["chunks"][3][0] = 9950; }},  // runs past data_size
      {"chunks[1]", [](json& j) { j["chunks"][1][1] = 0; }},
      {"chunks[0]", [](json& j) { j["chunks"][0][0] = 20000; }},
      {"chunk_size", [](json& j) { j["chunk_size"] = 5000; }},
      {"chunk_size", [](json& j) { j["chunk_size"] = 2048; }},
      {"meta_size", [](json& j) { j["meta_size"] = 100; }},
      {"meta_size", [](json& j) { j["meta_size"] = 4 * 4096; }},
      {"prefetch",
       [](json& j) {
         j["prefetch"] = json::array({0, 4});
       }},
      {"layer", [](json& j) { j["layer"] = "sha256:zz"; }},
      {"data", [](json& j) { j["data"] = "nope"; }},
      {"schema", [](json& j) { j["schema"] = 7; }},
  };
  for (const Case& c : cases) {
    json j = good;
    c.damage(j);
    SCOPED_TRACE(j.dump().substr(0, 300));
    expect_error([&] { chunk_index_from_json(j.dump()); }, Code::kInvalidArgument, {"chunk index", c.field});
  }
  // Missing or mistyped members are refused too (the message may come from the JSON library).
  for (const char* key : {"size", "layer", "data", "data_size", "chunk_size", "chunks", "schema"}) {
    json j = good;
    j.erase(key);
    SCOPED_TRACE(key);
    expect_error([&] { chunk_index_from_json(j.dump()); }, Code::kInvalidArgument, {"chunk index"});
  }
  expect_error([] { chunk_index_from_json("not json"); }, Code::kInvalidArgument, {"chunk index"});
}

// ---------------------------------------------------------------------------------------------------------------
// Chunked layers

struct Chunked {
  ChunkedLayer layer;
  std::string original;
};

Chunked chunk_file(const TempDir& tmp, const std::string& bytes, std::uint32_t chunk_size,
                   std::vector<std::uint32_t> prefetch = {0}, std::uint64_t meta_size = 0) {
  write_text(tmp / "layer.img", bytes);
  Chunked c;
  c.original = bytes;
  c.layer = write_chunked_layer(tmp / "layer.img", tmp / "layer.chunks", meta_size, std::move(prefetch), chunk_size);
  return c;
}

std::string decode_all(const ChunkIndex& index, const std::string& data) {
  std::string out, chunk;
  for (std::size_t i = 0; i < index.chunk_count(); ++i) {
    decode_chunk(index, i, std::string_view(data).substr(index.chunks[i].offset, index.chunks[i].length), chunk);
    EXPECT_EQ(chunk.size(), index.chunk_length(i));
    out += chunk;
  }
  return out;
}

TEST(ImageChunkedLayer, RandomDataRoundTripsStoredRaw) {
  TempDir tmp;
  const std::uint32_t chunk = 64 << 10;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> progress;
  write_text(tmp / "layer.img", random_bytes(2 * chunk + chunk / 2 + 3));
  ChunkedLayer c = write_chunked_layer(tmp / "layer.img", tmp / "layer.chunks", 2 * chunk, {0, 1, 1, 99}, chunk, 3,
                                       [&](std::uint64_t done, std::uint64_t total) {
                                         progress.push_back({done, total});
                                       });
  const std::string original = read_text(tmp / "layer.img");
  const std::string data = read_text(tmp / "layer.chunks");
  const ChunkIndex& index = c.index;

  EXPECT_EQ(index.layer, sha256_digest(original));
  EXPECT_EQ(index.size, original.size());
  EXPECT_EQ(index.meta_size, 2u * chunk);
  EXPECT_EQ(index.chunk_size, chunk);
  EXPECT_EQ(index.data, sha256_digest(data));
  EXPECT_EQ(index.data_size, data.size());
  EXPECT_EQ(index.prefetch, (std::vector<std::uint32_t>{0, 1}));  // sorted, deduplicated, chunk 99 dropped
  ASSERT_EQ(index.chunk_count(), 3u);
  // Random bytes do not compress: every chunk is stored raw, back to back.
  std::uint64_t at = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(index.chunks[i].length, index.chunk_length(i)) << i;
    EXPECT_EQ(index.chunks[i].offset, at);
    EXPECT_EQ("sha256:" + index.chunks[i].sha256_hex, sha256_digest(original.substr(i * chunk, index.chunk_length(i))));
    at += index.chunks[i].length;
  }
  EXPECT_EQ(decode_all(index, data), original);

  EXPECT_EQ(c.index_json, chunk_index_to_json(index));
  EXPECT_EQ(c.index_digest, sha256_digest(c.index_json));
  EXPECT_EQ(c.data_file, tmp / "layer.chunks");
  ChunkIndex parsed = chunk_index_from_json(c.index_json);
  EXPECT_EQ(decode_all(parsed, data), original);

  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back().first, original.size());
  EXPECT_EQ(progress.back().second, original.size());
}

TEST(ImageChunkedLayer, CompressibleDataRoundTripsCompressed) {
  TempDir tmp;
  const std::uint32_t chunk = 64 << 10;
  // Many chunks (more than one compression window) and a short last one.
  Chunked c = chunk_file(tmp, compressible_bytes(40 * chunk + 1), chunk);
  const std::string data = read_text(tmp / "layer.chunks");
  const ChunkIndex& index = c.layer.index;
  ASSERT_EQ(index.chunk_count(), 41u);
  EXPECT_EQ(index.chunk_length(40), 1u);
  for (std::size_t i = 0; i + 1 < index.chunk_count(); ++i) EXPECT_LT(index.chunks[i].length, chunk / 4) << i;
  EXPECT_LT(data.size(), c.original.size() / 4);
  EXPECT_EQ(decode_all(index, data), c.original);
  EXPECT_EQ(index.meta_size, 0u);
  EXPECT_EQ(index.prefetch, std::vector<std::uint32_t>{0});
}

TEST(ImageChunkedLayer, DamagedChunksAreDataLoss) {
  TempDir tmp;
  const std::uint32_t chunk = 4096;
  // Chunk 0 compresses, chunk 1 is stored raw.
  Chunked c = chunk_file(tmp, compressible_bytes(chunk) + random_bytes(chunk), chunk);
  const ChunkIndex& index = c.layer.index;
  const std::string data = read_text(tmp / "layer.chunks");
  ASSERT_LT(index.chunks[0].length, chunk);
  ASSERT_EQ(index.chunks[1].length, chunk);
  std::string out;
  for (std::size_t i = 0; i < 2; ++i) {
    std::string stored = data.substr(index.chunks[i].offset, index.chunks[i].length);
    for (std::size_t pos : {std::size_t{0}, stored.size() / 2, stored.size() - 1}) {
      std::string bad = stored;
      bad[pos] ^= 0x20;
      SCOPED_TRACE(fmt::format("chunk {} byte {}", i, pos));
      expect_error([&] { decode_chunk(index, i, bad, out); }, Code::kDataLoss,
                   {index.layer, fmt::format("chunk {}", i)});
    }
    expect_error([&] { decode_chunk(index, i, stored.substr(0, stored.size() - 1), out); }, Code::kDataLoss);
    expect_error([&] { decode_chunk(index, i, "", out); }, Code::kDataLoss);
    decode_chunk(index, i, stored, out);  // the undamaged bytes still decode
  }
  expect_error([&] { decode_chunk(index, 2, data, out); }, Code::kOutOfRange);

  // An index whose digest for a chunk is wrong catches good bytes too.
  ChunkIndex wrong = index;
  wrong.chunks[0].sha256_hex = std::string(64, '0');
  expect_error([&] { decode_chunk(wrong, 0, data.substr(0, index.chunks[0].length), out); }, Code::kDataLoss,
               {"sha256 mismatch"});
}

TEST(ImageChunkedLayer, RefusesEmptyAndMissingFiles) {
  TempDir tmp;
  write_text(tmp / "empty", "");
  expect_error([&] { write_chunked_layer(tmp / "empty", tmp / "out", 0); }, Code::kInvalidArgument, {"empty"});
  expect_error([&] { write_chunked_layer(tmp / "missing", tmp / "out", 0); }, Code::kNotFound, {"missing"});
}

// ---------------------------------------------------------------------------------------------------------------
// The directory store

TEST(ImageDirectoryStore, PutGetRangeHasRemove) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  EXPECT_EQ(store->url(), (tmp / "store").string());
  const std::string bytes = random_bytes(100000, 7);
  const std::string d = sha256_digest(bytes);
  EXPECT_FALSE(store->has_blob(d));
  EXPECT_TRUE(store->list_blobs().empty());
  store->put_blob(d, bytes);
  EXPECT_TRUE(store->has_blob(d));
  EXPECT_TRUE(fs::is_regular_file(tmp / ("store/blobs/sha256/" + digest_hex(d))));
  EXPECT_EQ(store->read_blob(d), bytes);
  EXPECT_EQ(store->read_range(d, 0, 10), bytes.substr(0, 10));
  EXPECT_EQ(store->read_range(d, 99990, 10), bytes.substr(99990));
  EXPECT_EQ(store->read_range(d, 100000, 0), "");
  EXPECT_EQ(store->read_range(d, 4096, 50000), bytes.substr(4096, 50000));
  expect_error([&] { store->read_range(d, 99995, 10); }, Code::kOutOfRange, {d});
  expect_error([&] { store->read_range(d, 200000, 1); }, Code::kOutOfRange);
  expect_error([&] { store->read_blob(d, 99999); }, Code::kResourceExhausted, {d});
  store->put_blob(d, bytes);  // again: a no-op

  // From a file, in another directory.
  const std::string other = compressible_bytes(5000);
  write_text(tmp / "elsewhere/blob", other);
  const std::string d2 = sha256_digest(other);
  store->put_blob_file(d2, tmp / "elsewhere/blob");
  EXPECT_EQ(store->read_blob(d2), other);
  store->put_blob(kEmptySha, "");
  EXPECT_EQ(store->read_blob(kEmptySha), "");

  auto blobs = store->list_blobs();
  ASSERT_EQ(blobs.size(), 3u);
  EXPECT_TRUE(std::is_sorted(blobs.begin(), blobs.end(), [](auto& a, auto& b) { return a.digest < b.digest; }));
  for (const auto& b : blobs) {
    EXPECT_EQ(b.size, b.digest == d ? 100000u : b.digest == d2 ? 5000u : 0u) << b.digest;
    EXPECT_GT(b.modified, 1.6e9);
  }
  // Stray files in the blob directory are not blobs.
  write_text(tmp / "store/blobs/sha256/junk", "x");
  write_text(tmp / ("store/blobs/sha256/" + std::string(64, 'A')), "x");
  EXPECT_EQ(store->list_blobs().size(), 3u);

  store->remove_blob(d);
  EXPECT_FALSE(store->has_blob(d));
  expect_error([&] { store->read_blob(d); }, Code::kNotFound, {d, store->url()});
  expect_error([&] { store->read_range(d, 0, 1); }, Code::kNotFound, {d});
  store->remove_blob(d);  // a blob that is not there: nothing to do
  EXPECT_EQ(store->list_blobs().size(), 2u);
  EXPECT_TRUE(testing::entries_with_prefix(tmp / "store/.tmp", "").empty());

  expect_error([&] { store->put_blob("sha256:abc", "x"); }, Code::kInvalidArgument);
  expect_error([&] { store->read_blob("../../etc/passwd"); }, Code::kInvalidArgument);
  EXPECT_THROW(store->has_blob("sha256:../x"), Error);
}

TEST(ImageDirectoryStore, MismatchedPutIsDataLossAndLeavesNothing) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  const std::string claimed = sha256_digest("the right bytes");
  expect_error([&] { store->put_blob(claimed, "the wrong bytes"); }, Code::kDataLoss, {claimed});
  write_text(tmp / "wrong", "the wrong bytes");
  expect_error([&] { store->put_blob_file(claimed, tmp / "wrong"); }, Code::kDataLoss, {claimed});
  EXPECT_FALSE(store->has_blob(claimed));
  EXPECT_TRUE(store->list_blobs().empty());
  EXPECT_FALSE(fs::exists(tmp / ("store/blobs/sha256/" + digest_hex(claimed))));
  EXPECT_TRUE(testing::entries_with_prefix(tmp / "store/.tmp", "").empty());
  expect_error([&] { store->put_blob_file(claimed, tmp / "missing"); }, Code::kNotFound);
  // The right bytes then go in.
  store->put_blob(claimed, "the right bytes");
  EXPECT_EQ(store->read_blob(claimed), "the right bytes");
}

TEST(ImageDirectoryStore, DamagedBlobOnDiskIsDataLoss) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  const std::string bytes = random_bytes(10000, 3);
  const std::string d = sha256_digest(bytes);
  store->put_blob(d, bytes);
  fs::path file = tmp / ("store/blobs/sha256/" + digest_hex(d));
  std::string damaged = bytes;
  damaged[5000] ^= 1;
  ::chmod(file.c_str(), 0644);
  write_text(file, damaged);
  expect_error([&] { store->read_blob(d); }, Code::kDataLoss, {d, "damaged"});
  // Ranges are not verified as a whole (chunk readers check each chunk): the bytes come back as stored.
  EXPECT_EQ(store->read_range(d, 4990, 20), damaged.substr(4990, 20));
  // A truncated blob too.
  write_text(file, bytes.substr(0, 9999));
  expect_error([&] { store->read_blob(d); }, Code::kDataLoss, {d});
  // A symlink in place of a blob is not followed.
  fs::remove(file);
  write_text(tmp / "outside", bytes);
  fs::create_symlink(tmp / "outside", file);
  EXPECT_FALSE(store->has_blob(d));
  EXPECT_THROW(store->read_blob(d), Error);
}

TEST(ImageDirectoryStore, Refs) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  EXPECT_FALSE(store->read_ref("busybox:latest"));
  EXPECT_TRUE(store->list_refs().empty());
  store->write_ref("swe/task-17:latest", fake_digest('1'));
  store->write_ref("busybox", fake_digest('2'));  // the tag defaults to latest
  store->write_ref("busybox:1", fake_digest('3'));
  EXPECT_TRUE(fs::is_regular_file(tmp / "store/refs/swe%2Ftask-17%3Alatest"));
  EXPECT_EQ(read_text(tmp / "store/refs/busybox%3Alatest"), fake_digest('2') + "\n");
  EXPECT_EQ(store->read_ref("swe/task-17:latest"), fake_digest('1'));
  EXPECT_EQ(store->read_ref("swe/task-17"), fake_digest('1'));
  EXPECT_EQ(store->read_ref("busybox:latest"), fake_digest('2'));
  EXPECT_EQ(store->list_refs(), (std::vector<std::string>{"busybox:1", "busybox:latest", "swe/task-17:latest"}));

  store->write_ref("busybox:latest", fake_digest('4'));  // retagging replaces
  EXPECT_EQ(store->read_ref("busybox"), fake_digest('4'));

  EXPECT_TRUE(store->remove_ref("busybox:1"));
  EXPECT_FALSE(store->remove_ref("busybox:1"));
  EXPECT_FALSE(store->read_ref("busybox:1"));
  EXPECT_EQ(store->list_refs(), (std::vector<std::string>{"busybox:latest", "swe/task-17:latest"}));

  expect_error([&] { store->write_ref("ok:tag", "sha256:short"); }, Code::kInvalidArgument);
  expect_error([&] { store->write_ref("Bad Name", fake_digest('1')); }, Code::kInvalidArgument, {"invalid image name"});
  expect_error([&] { store->read_ref("a//b"); }, Code::kInvalidArgument);

  // Files in refs/ that this store did not write are not listed; a ref file with garbage is DATA_LOSS.
  write_text(tmp / "store/refs/.hidden%3Ax", fake_digest('1'));
  write_text(tmp / "store/refs/not a ref", fake_digest('1'));
  write_text(tmp / "store/refs/junk%3Av1", "hello\n");
  EXPECT_EQ(store->list_refs(), (std::vector<std::string>{"busybox:latest", "junk:v1", "swe/task-17:latest"}));
  expect_error([&] { store->read_ref("junk:v1"); }, Code::kDataLoss, {"junk:v1"});
  EXPECT_TRUE(testing::entries_with_prefix(tmp / "store/.tmp", "").empty());
}

TEST(ImageDirectoryStore, ConcurrentPutsOfOneBlob) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  const std::string bytes = random_bytes(1 << 20, 9);
  const std::string d = sha256_digest(bytes);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 5; ++i) {
        try {
          store->put_blob(d, bytes);
          if (store->read_blob(d) != bytes) ++failures;
        } catch (...) {
          ++failures;
        }
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(store->list_blobs().size(), 1u);
  EXPECT_TRUE(testing::entries_with_prefix(tmp / "store/.tmp", "").empty());
}

TEST(ImageDirectoryStore, OpenStoreUrls) {
  TempDir tmp;
  auto a = open_store("file://" + (tmp / "a").string());
  EXPECT_EQ(a->url(), (tmp / "a").string());
  a->put_blob(kAbcSha, "abc");
  EXPECT_TRUE(fs::exists(tmp / ("a/blobs/sha256/" + digest_hex(kAbcSha))));
  auto b = open_store((tmp / "b").string());
  EXPECT_EQ(b->url(), (tmp / "b").string());
  expect_error([] { open_store(""); }, Code::kInvalidArgument);
  expect_error([] { open_store("file://relative/path"); }, Code::kInvalidArgument, {"absolute"});
  expect_error([] { open_store("ftp://host/x"); }, Code::kInvalidArgument, {"scheme"});
  expect_error([] { open_store("s3://bucket"); }, Code::kInvalidArgument, {"scheme"});
  // A relative directory is taken from the current directory, and the store's URL says where it really is.
  auto rel = open_store("relative-store-dir");
  EXPECT_TRUE(fs::path(rel->url()).is_absolute()) << rel->url();
  EXPECT_FALSE(fs::exists("relative-store-dir")) << "opening a store must not create it";
}

// ---------------------------------------------------------------------------------------------------------------
// The catalog

// A layer of `size` deterministic bytes, chunked and stored in `store`, as a manifest names it.
LayerDescriptor store_layer(BlobStore& store, const fs::path& dir, std::size_t size, std::uint64_t seed,
                            LayerRole role = LayerRole::kBase) {
  fs::create_directories(dir);
  const fs::path img = dir / fmt::format("layer-{}.img", seed), chunks = dir / fmt::format("layer-{}.chunks", seed);
  write_text(img, random_bytes(size / 2, seed) + compressible_bytes(size - size / 2));
  ChunkedLayer c = write_chunked_layer(img, chunks, 0, {0}, 64 << 10);
  store.put_blob_file(c.index.data, chunks);
  store.put_blob(c.index_digest, c.index_json);
  LayerDescriptor d;
  d.role = role;
  d.digest = c.index.layer;
  d.size = c.index.size;
  d.index = c.index_digest;
  d.data = c.index.data;
  d.stored_size = c.index.data_size;
  d.files_size = size;
  return d;
}

Manifest manifest_of(const std::string& tagged, std::vector<LayerDescriptor> layers) {
  ImageReference ref = parse_reference(tagged);
  Manifest m;
  m.name = ref.name;
  m.tag = ref.tag;
  m.layers = std::move(layers);
  m.created_at = 1747750000;
  m.source = "test";
  return m;
}

std::set<std::string> blob_set(BlobStore& store) {
  std::set<std::string> out;
  for (const auto& b : store.list_blobs()) out.insert(b.digest);
  return out;
}

void age_all_blobs(const fs::path& store_root, int seconds_ago) {
  struct timespec t[2];
  t[0].tv_sec = t[1].tv_sec = ::time(nullptr) - seconds_ago;
  t[0].tv_nsec = t[1].tv_nsec = 0;
  for (const auto& e : fs::directory_iterator(store_root / "blobs/sha256"))
    ASSERT_EQ(::utimensat(AT_FDCWD, e.path().c_str(), t, AT_SYMLINK_NOFOLLOW), 0) << e.path();
}

TEST(ImageCatalog, CommitRefusesMissingBlobsAndWritesNoTag) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  LayerDescriptor present = store_layer(*store, tmp / "work", 100000, 1);
  LayerDescriptor absent = present;
  absent.data = fake_digest('d');
  absent.digest = fake_digest('e');
  const auto before = blob_set(*store);
  expect_error(
      [&] {
        commit_manifest(*store, manifest_of("app:v1", {present, absent}));
      },
      Code::kFailedPrecondition, {"app:v1", fake_digest('d'), store->url()});
  LayerDescriptor no_index = present;
  no_index.index = fake_digest('f');
  expect_error([&] { commit_manifest(*store, manifest_of("app:v1", {no_index})); }, Code::kFailedPrecondition,
               {fake_digest('f')});
  EXPECT_FALSE(store->read_ref("app:v1"));
  EXPECT_TRUE(store->list_refs().empty());
  EXPECT_EQ(blob_set(*store), before) << "a refused commit stored its manifest";

  std::string digest = commit_manifest(*store, manifest_of("app:v1", {present}));
  EXPECT_EQ(store->read_ref("app:v1"), digest);
  ResolvedManifest by_tag = fetch_manifest(*store, parse_reference("app:v1"));
  EXPECT_EQ(by_tag.digest, digest);
  EXPECT_EQ(by_tag.reference.digest, digest);
  EXPECT_EQ(by_tag.reference.tagged(), "app:v1");
  EXPECT_EQ(sha256_digest(by_tag.json), digest);
  EXPECT_EQ(by_tag.manifest.layers.size(), 1u);
  EXPECT_EQ(by_tag.manifest.layers[0].data, present.data);
  ResolvedManifest pinned = fetch_manifest(*store, parse_reference("app:v1@" + digest));
  EXPECT_EQ(pinned.json, by_tag.json);
  EXPECT_EQ(blobs_of(by_tag), (std::vector<std::string>{digest, present.index, present.data}));
}

TEST(ImageCatalog, FetchManifestErrors) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  expect_error([&] { fetch_manifest(*store, parse_reference("ghost:v1")); }, Code::kNotFound,
               {"ghost:v1", store->url()});
  // A tag that points at a manifest the store lacks: the store is damaged.
  store->write_ref("broken:v1", fake_digest('9'));
  expect_error([&] { fetch_manifest(*store, parse_reference("broken:v1")); }, Code::kDataLoss,
               {"broken:v1", fake_digest('9'), store->url()});
  // A pinned digest that is not there is just not found.
  expect_error([&] { fetch_manifest(*store, parse_reference("ghost@" + fake_digest('8'))); }, Code::kNotFound,
               {fake_digest('8')});
  // A tag pointing at a blob that is not a manifest.
  const std::string junk = "{\"not\":\"a manifest\"}";
  store->put_blob(sha256_digest(junk), junk);
  store->write_ref("junk:v1", sha256_digest(junk));
  expect_error([&] { fetch_manifest(*store, parse_reference("junk:v1")); }, Code::kDataLoss, {"junk:v1"});
  // A manifest blob damaged on disk.
  LayerDescriptor layer = store_layer(*store, tmp / "work", 5000, 2);
  std::string digest = commit_manifest(*store, manifest_of("ok:v1", {layer}));
  write_text(tmp / ("store/blobs/sha256/" + digest_hex(digest)), "{}");
  expect_error([&] { fetch_manifest(*store, parse_reference("ok:v1")); }, Code::kDataLoss, {digest});

  // Several stores: NOT_FOUND names all of them; the first store that has the image answers.
  auto second = open_directory_store(tmp / "second");
  LayerDescriptor l2 = store_layer(*second, tmp / "work2", 5000, 3);
  commit_manifest(*second, manifest_of("only-in-second", {l2}));
  auto first = open_directory_store(tmp / "first");
  std::vector<BlobStore*> both{first.get(), second.get()};
  EXPECT_EQ(fetch_manifest(both, parse_reference("only-in-second")).manifest.layers[0].data, l2.data);
  expect_error([&] { fetch_manifest(both, parse_reference("nowhere")); }, Code::kNotFound,
               {"nowhere:latest", first->url(), second->url()});
  expect_error([&] { fetch_manifest(std::vector<BlobStore*>{}, parse_reference("x")); }, Code::kFailedPrecondition);
}

TEST(ImageCatalog, CopyImageCopiesOnlyMissingBlobs) {
  TempDir tmp;
  auto src = open_directory_store(tmp / "src");
  auto dst = open_directory_store(tmp / "dst");
  LayerDescriptor base = store_layer(*src, tmp / "work", 3 << 20, 11);
  LayerDescriptor task = store_layer(*src, tmp / "work", 600000, 12, LayerRole::kTask);
  const std::string d1 = commit_manifest(*src, manifest_of("app:v1", {base, task}));
  const std::string index_bytes = src->read_blob(base.index) + src->read_blob(task.index);

  std::vector<std::string> said;
  std::uint64_t last_done = 0, last_total = 0;
  std::uint64_t first = copy_image(*src, *dst, parse_reference("app:v1"),
                                   [&](std::string_view what, std::uint64_t done, std::uint64_t total) {
                                     said.emplace_back(what);
                                     EXPECT_GE(done, last_done);
                                     last_done = done;
                                     last_total = total;
                                   });
  const std::uint64_t manifest_bytes = src->read_blob(d1).size();
  EXPECT_EQ(first, base.stored_size + task.stored_size + index_bytes.size() + manifest_bytes);
  EXPECT_EQ(last_done, base.stored_size + task.stored_size);
  EXPECT_EQ(last_total, base.stored_size + task.stored_size);
  ASSERT_FALSE(said.empty());
  EXPECT_NE(said.front().find("layer 1/2"), std::string::npos) << said.front();
  EXPECT_EQ(blob_set(*dst), blob_set(*src));
  EXPECT_EQ(dst->read_ref("app:v1"), d1);
  EXPECT_EQ(dst->read_blob(base.data, 64 << 20), src->read_blob(base.data, 64 << 20));
  EXPECT_EQ(fetch_manifest(*dst, parse_reference("app:v1")).json, src->read_blob(d1));

  // Again: only the manifest (a few hundred bytes) is written, no layer bytes.
  std::uint64_t second = copy_image(*src, *dst, parse_reference("app:v1"));
  EXPECT_EQ(second, manifest_bytes);
  EXPECT_LT(second, 4096u);

  // An image sharing the base layer: only its own layer travels.
  LayerDescriptor other = store_layer(*src, tmp / "work", 200000, 13, LayerRole::kTask);
  const std::string d2 = commit_manifest(*src, manifest_of("app:v2", {base, other}));
  std::uint64_t third = copy_image(*src, *dst, parse_reference("app:v2"));
  EXPECT_EQ(third, other.stored_size + src->read_blob(other.index).size() + src->read_blob(d2).size());
  EXPECT_EQ(dst->read_ref("app:v2"), d2);
  EXPECT_EQ(dst->list_refs(), (std::vector<std::string>{"app:v1", "app:v2"}));

  // Pinned copies and errors.
  expect_error([&] { copy_image(*src, *dst, parse_reference("ghost")); }, Code::kNotFound, {"ghost", src->url()});
  EXPECT_TRUE(testing::entries_with_prefix(tmp / "dst/.tmp", "").empty());
  EXPECT_TRUE(
      testing::entries_with_prefix(fs::temp_directory_path(), fmt::format("dsec-copy-{}-", ::getpid())).empty());
}

TEST(ImageCatalog, CopyImageRefusesDamagedSources) {
  TempDir tmp;
  auto src = open_directory_store(tmp / "src");
  auto dst = open_directory_store(tmp / "dst");
  LayerDescriptor layer = store_layer(*src, tmp / "work", 300000, 21);
  commit_manifest(*src, manifest_of("app:v1", {layer}));
  // The data blob damaged at the source: the destination verifies it and refuses; no tag appears there.
  fs::path data = tmp / ("src/blobs/sha256/" + digest_hex(layer.data));
  std::string bytes = read_text(data);
  bytes[bytes.size() / 2] ^= 0x40;
  ::chmod(data.c_str(), 0644);
  write_text(data, bytes);
  expect_error([&] { copy_image(*src, *dst, parse_reference("app:v1")); }, Code::kDataLoss, {layer.data});
  EXPECT_FALSE(dst->read_ref("app:v1"));
  EXPECT_FALSE(dst->has_blob(layer.data));

  // A manifest whose layer names a chunk index of another layer.
  LayerDescriptor other = store_layer(*src, tmp / "work", 10000, 22);
  LayerDescriptor mixed = other;
  mixed.index = layer.index;
  commit_manifest(*src, manifest_of("mixed:v1", {mixed}));
  auto fresh = open_directory_store(tmp / "fresh");
  expect_error([&] { copy_image(*src, *fresh, parse_reference("mixed:v1")); }, Code::kDataLoss, {"does not match"});
  EXPECT_FALSE(fresh->read_ref("mixed:v1"));
}

TEST(ImageCatalog, AFlippedByteInAStoredChunkIsDataLoss) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  LayerDescriptor layer = store_layer(*store, tmp / "work", 1 << 20, 61);
  const ChunkIndex index = chunk_index_from_json(store->read_blob(layer.index));
  ASSERT_GE(index.chunk_count(), 4u);
  // Damage one byte inside chunk 2 of the data blob, as a bad disk would.
  fs::path blob = tmp / ("store/blobs/sha256/" + digest_hex(layer.data));
  std::string bytes = read_text(blob);
  bytes[index.chunks[2].offset + index.chunks[2].length / 2] ^= 0x01;
  ::chmod(blob.c_str(), 0644);
  write_text(blob, bytes);
  std::string out;
  for (std::size_t i = 0; i < index.chunk_count(); ++i) {
    std::string stored = store->read_range(layer.data, index.chunks[i].offset, index.chunks[i].length);
    if (i == 2) {
      expect_error([&] { decode_chunk(index, i, stored, out); }, Code::kDataLoss, {"chunk 2", layer.digest});
    } else {
      EXPECT_NO_THROW(decode_chunk(index, i, stored, out)) << "chunk " << i;
    }
  }
  expect_error([&] { store->read_blob(layer.data, 64 << 20); }, Code::kDataLoss, {layer.data});
}

TEST(ImageGc, RemovesOnlyUnreferencedBlobsOutsideTheGrace) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  LayerDescriptor shared = store_layer(*store, tmp / "work", 100000, 31);
  LayerDescriptor a_only = store_layer(*store, tmp / "work", 50000, 32);
  LayerDescriptor b_only = store_layer(*store, tmp / "work", 50000, 33);
  const std::string da = commit_manifest(*store, manifest_of("a", {shared, a_only}));
  const std::string db = commit_manifest(*store, manifest_of("b", {shared, b_only}));
  const std::string orphan_old = "an old blob no image needs";
  store->put_blob(sha256_digest(orphan_old), orphan_old);
  age_all_blobs(tmp / "store", 3600);
  const std::string orphan_new = "a blob written a moment ago";
  store->put_blob(sha256_digest(orphan_new), orphan_new);
  const auto all = blob_set(*store);
  ASSERT_EQ(all.size(), 3u * 2 + 2 + 2);

  // Dry run: says what would go, removes nothing.
  GcResult dry = collect_garbage(*store, std::chrono::minutes(10), true);
  EXPECT_EQ(dry.removed, std::vector<std::string>{sha256_digest(orphan_old)});
  EXPECT_EQ(dry.removed_bytes, orphan_old.size());
  EXPECT_EQ(dry.kept, all.size() - 1);
  EXPECT_EQ(blob_set(*store), all);

  GcResult r = collect_garbage(*store, std::chrono::minutes(10));
  EXPECT_EQ(r.removed, std::vector<std::string>{sha256_digest(orphan_old)});
  EXPECT_TRUE(r.damaged_refs.empty());
  EXPECT_FALSE(store->has_blob(sha256_digest(orphan_old)));
  EXPECT_TRUE(store->has_blob(sha256_digest(orphan_new))) << "a blob inside the grace was removed";

  // Without a grace the new orphan goes too; both images stay whole.
  r = collect_garbage(*store, std::chrono::seconds(0));
  EXPECT_EQ(r.removed, std::vector<std::string>{sha256_digest(orphan_new)});
  for (const char* name : {"a", "b"}) {
    ResolvedManifest image = fetch_manifest(*store, parse_reference(name));
    for (const auto& blob : blobs_of(image)) EXPECT_TRUE(store->has_blob(blob)) << name << " lost " << blob;
  }

  // Untag a: its own layer and manifest go, the shared layer stays for b.
  const std::uint64_t a_bytes =
      store->read_blob(da).size() + store->read_blob(a_only.index).size() + a_only.stored_size;
  ASSERT_TRUE(store->remove_ref("a:latest"));
  r = collect_garbage(*store, std::chrono::seconds(0));
  std::vector<std::string> expected{da, a_only.index, a_only.data};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(r.removed, expected);
  EXPECT_EQ(r.removed_bytes, a_bytes);
  EXPECT_EQ(blob_set(*store), (std::set<std::string>{db, shared.index, shared.data, b_only.index, b_only.data}));
  EXPECT_TRUE(collect_garbage(*store, std::chrono::seconds(0)).removed.empty());
}

TEST(ImageGc, RemovedBytesAddUp) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  std::uint64_t total = 0;
  for (int i = 0; i < 5; ++i) {
    std::string b = random_bytes(1000 * (i + 1), 100 + i);
    store->put_blob(sha256_digest(b), b);
    total += b.size();
  }
  age_all_blobs(tmp / "store", 7200);
  GcResult r = collect_garbage(*store, std::chrono::hours(1));
  EXPECT_EQ(r.removed.size(), 5u);
  EXPECT_EQ(r.removed_bytes, total);
  EXPECT_EQ(r.kept, 0u);
  EXPECT_TRUE(store->list_blobs().empty());
}

// A blob that a build or push stores again (the store had it already, unreferenced and old) is as fresh as a newly
// written one: a gc running between that write and the tag must not take it, or the tag would name a missing blob.
TEST(ImageGc, ReStoringAnOldBlobRenewsItsGrace) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  LayerDescriptor layer = store_layer(*store, tmp / "work", 80000, 41);
  age_all_blobs(tmp / "store", 3600);
  // A build makes the same layer again: its blobs go in (already there), then gc runs, then the tag.
  LayerDescriptor again = store_layer(*store, tmp / "work-again", 80000, 41);
  ASSERT_EQ(again.data, layer.data);
  GcResult r = collect_garbage(*store, std::chrono::minutes(10));
  EXPECT_TRUE(r.removed.empty()) << "gc removed " << r.removed.size() << " blobs a build had just stored";
  EXPECT_NO_THROW(commit_manifest(*store, manifest_of("rebuilt", {again})));
}

// A blob stored from a file that was written long ago (the directory store links it in when it can) is still a
// freshly stored blob: gc's grace counts from the put, not from the file's own mtime.
TEST(ImageGc, ABlobStoredFromAnOldFileIsFresh) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  const std::string bytes = random_bytes(50000, 71);
  write_text(tmp / "store/.tmp/old-file", bytes);  // on the store's filesystem: linked, not copied
  write_text(tmp / "old-elsewhere", bytes + "x");
  struct timespec t[2];
  t[0].tv_sec = t[1].tv_sec = ::time(nullptr) - 86400;
  t[0].tv_nsec = t[1].tv_nsec = 0;
  ASSERT_EQ(::utimensat(AT_FDCWD, (tmp / "store/.tmp/old-file").c_str(), t, 0), 0);
  ASSERT_EQ(::utimensat(AT_FDCWD, (tmp / "old-elsewhere").c_str(), t, 0), 0);
  store->put_blob_file(sha256_digest(bytes), tmp / "store/.tmp/old-file");
  store->put_blob_file(sha256_digest(bytes + "x"), tmp / "old-elsewhere");
  GcResult r = collect_garbage(*store, std::chrono::minutes(10));
  EXPECT_TRUE(r.removed.empty()) << "gc removed a blob stored a moment ago: " << r.removed.size();
  EXPECT_EQ(store->read_blob(sha256_digest(bytes)), bytes);
}

TEST(ImageGc, DamagedRefsKeepTheirBlobs) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  LayerDescriptor layer = store_layer(*store, tmp / "work", 30000, 51);
  const std::string digest = commit_manifest(*store, manifest_of("good", {layer}));
  const std::string junk = "not a manifest at all";
  store->put_blob(sha256_digest(junk), junk);
  store->write_ref("bad:v1", sha256_digest(junk));
  age_all_blobs(tmp / "store", 3600);
  GcResult r = collect_garbage(*store, std::chrono::seconds(0));
  ASSERT_EQ(r.damaged_refs.size(), 1u);
  EXPECT_NE(r.damaged_refs[0].find("bad:v1"), std::string::npos) << r.damaged_refs[0];
  EXPECT_TRUE(r.removed.empty());
  EXPECT_TRUE(store->has_blob(sha256_digest(junk)));
  EXPECT_TRUE(store->has_blob(digest));
}

}  // namespace
}  // namespace dsec::image
