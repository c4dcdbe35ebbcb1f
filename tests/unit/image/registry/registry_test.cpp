// Registry references, image documents, credentials and the manifest's image config: the parts of registry images
// that need no registry (test_registry.py drives a real one).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "dsec/error.hpp"
#include "image/image_test_util.hpp"
#include "image/registry/credentials.hpp"
#include "image/registry/import.hpp"
#include "image/registry/oci_image.hpp"
#include "image/registry/registry_client.hpp"
#include "image/store/manifest.hpp"

namespace dsec::image::registry {
namespace {

using nlohmann::json;
using testing::expect_error;
using testing::TempDir;
using testing::write_text;

const std::string kDigestA = "sha256:" + std::string(64, 'a');
const std::string kDigestB = "sha256:" + std::string(64, 'b');

TEST(RegistryReference, AHostFirstNamesARegistry) {
  ImageReference r = parse_reference("Registry.Example:5000/swebench/sweb.eval.x86_64.django__django-11099:latest");
  EXPECT_EQ(r.name, "registry.example:5000/swebench/sweb.eval.x86_64.django__django-11099");
  EXPECT_EQ(r.registry(), "registry.example:5000");
  EXPECT_EQ(r.repository(), "swebench/sweb.eval.x86_64.django__django-11099");
  EXPECT_EQ(r.tag, "latest");
  r = parse_reference("localhost/app@" + kDigestA);
  EXPECT_EQ(r.registry(), "localhost");
  EXPECT_EQ(r.repository(), "app");
  EXPECT_EQ(r.digest, kDigestA);
  r = parse_reference("127.0.0.1:5000/a:v1@" + kDigestA);
  EXPECT_EQ(r.registry(), "127.0.0.1:5000");
  EXPECT_EQ(r.to_string(), "127.0.0.1:5000/a:v1@" + kDigestA);
  // Bare names are dsec's stores' (no dot, no port, not localhost).
  for (const char* bare : {"busybox", "swe/task-17:v2", "library/python:3.12"})
    EXPECT_EQ(parse_reference(bare).registry(), "") << bare;
  EXPECT_EQ(parse_reference("swe/task-17").repository(), "swe/task-17");
}

TEST(RegistryReference, BadHostsAreRefusedSayingWhy) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"h:0/a", "port"},
      {"h:99999/a", "port"},
      {"h:x/a", "port"},
      {"h:/a", "port"},
      {":5000/a", "no name before the tag"},
      {"a..b/c", "empty label"},
      {"a-.b/c", "starts or ends with '-'"},
      {"-a.b/c", "must start with a letter or digit"},
      {"a_b.c/d", "'_' is not allowed in the registry host"},
      {"h.io/", "no repository after the registry host"},
      {"h.io:5000/a:b:c", "more than one ':'"},
  };
  for (const auto& [text, why] : bad) {
    SCOPED_TRACE(text);
    expect_error([&] { parse_reference(text); }, Code::kInvalidArgument, {"invalid image name", why});
  }
}

TEST(RegistryReference, DefaultRegistryExpandsAsDockerDoes) {
  EXPECT_EQ(with_default_registry(parse_reference("python:3.12"), "docker.io").to_string(),
            "docker.io/library/python:3.12");
  EXPECT_EQ(with_default_registry(parse_reference("swe/task"), "docker.io").to_string(), "docker.io/swe/task:latest");
  EXPECT_EQ(with_default_registry(parse_reference("app:v1"), "reg.example:5000").to_string(),
            "reg.example:5000/app:v1");
  EXPECT_EQ(with_default_registry(parse_reference("other.io/x:v1"), "docker.io").to_string(), "other.io/x:v1");
  EXPECT_EQ(with_default_registry(parse_reference("app"), "").to_string(), "app:latest");
  // A registry pinned by its digest is imported under a tag of its own.
  EXPECT_EQ(import_tag(parse_reference("h.io/a:v1@" + kDigestA)).tagged(), "h.io/a:sha256-" + std::string(64, 'a'));
  EXPECT_EQ(import_tag(parse_reference("h.io/a:v1")).tagged(), "h.io/a:v1");
}

TEST(RegistryLayers, ConvertedLayersHaveRefsOfTheirOwn) {
  EXPECT_EQ(oci_layer_ref({kDigestA}), "oci-layer/sha256:" + std::string(64, 'a'));
  std::string merged = oci_layer_ref({kDigestA, kDigestB});
  EXPECT_TRUE(merged.starts_with("oci-layers/sha256:"));
  EXPECT_NE(merged, oci_layer_ref({kDigestB, kDigestA}));  // the order is part of what the layers are
  for (const auto& ref : {oci_layer_ref({kDigestA}), merged}) {
    EXPECT_TRUE(is_oci_layer_ref(ref));
    EXPECT_EQ(parse_reference(ref).tagged(), ref);  // a valid store ref
  }
  EXPECT_FALSE(is_oci_layer_ref("busybox:latest"));
}

std::string layer_json(const std::string& type, const std::string& digest, std::uint64_t size) {
  return json{{"mediaType", type}, {"digest", digest}, {"size", size}}.dump();
}

TEST(RegistryDocuments, ManifestsOfBothKindsAndTheirLayers) {
  std::string oci = R"({"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":)" +
                    layer_json("application/vnd.oci.image.config.v1+json", kDigestA, 100) + R"(,"layers":[)" +
                    layer_json("application/vnd.oci.image.layer.v1.tar+gzip", kDigestA, 10) + "," +
                    layer_json("application/vnd.oci.image.layer.v1.tar+zstd", kDigestB, 20) + "," +
                    layer_json("application/vnd.oci.image.layer.v1.tar", kDigestB, 30) + "]}";
  ManifestDocument m = parse_manifest(oci, "");
  EXPECT_FALSE(m.is_index);
  ASSERT_EQ(m.layers.size(), 3u);
  EXPECT_EQ(m.layers[0].compression, LayerCompression::kGzip);
  EXPECT_EQ(m.layers[1].compression, LayerCompression::kZstd);
  EXPECT_EQ(m.layers[2].compression, LayerCompression::kNone);
  EXPECT_EQ(m.config.size, 100u);
  // Docker schema 2, its type only in Content-Type.
  std::string docker = R"({"schemaVersion":2,"config":)" +
                       layer_json("application/vnd.docker.container.image.v1+json", kDigestA, 5) + R"(,"layers":[)" +
                       layer_json("application/vnd.docker.image.rootfs.diff.tar.gzip", kDigestB, 7) + "]}";
  m = parse_manifest(docker, "application/vnd.docker.distribution.manifest.v2+json; charset=utf-8");
  EXPECT_EQ(m.media_type, "application/vnd.docker.distribution.manifest.v2+json");
  EXPECT_EQ(m.layers.at(0).compression, LayerCompression::kGzip);
}

TEST(RegistryDocuments, IndexesPickThePlatformOrSayWhatTheyHave) {
  auto entry = [](const std::string& digest, const std::string& arch, const std::string& variant) {
    json e{{"mediaType", "application/vnd.oci.image.manifest.v1+json"}, {"digest", digest}, {"size", 10}};
    e["platform"] = {{"os", "linux"}, {"architecture", arch}};
    if (!variant.empty()) e["platform"]["variant"] = variant;
    return e;
  };
  json index{{"schemaVersion", 2},
             {"mediaType", "application/vnd.oci.image.index.v1+json"},
             {"manifests", {entry(kDigestA, "arm64", "v8"), entry(kDigestB, "amd64", "")}}};
  ManifestDocument doc = parse_manifest(index.dump(), "");
  ASSERT_TRUE(doc.is_index);
  auto picked = pick_platform(doc, parse_platform("linux/amd64"));
  ASSERT_TRUE(picked);
  EXPECT_EQ(picked->digest, kDigestB);
  EXPECT_EQ(pick_platform(doc, parse_platform("linux/arm64"))->digest, kDigestA);
  EXPECT_FALSE(pick_platform(doc, parse_platform("linux/s390x")));
  EXPECT_EQ(platforms_of(doc), "linux/amd64, linux/arm64/v8");
}

TEST(RegistryDocuments, MalformedOrUnsupportedDocumentsAreNamed) {
  const std::string config = layer_json("application/vnd.oci.image.config.v1+json", kDigestA, 1);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"[]", "must be an object"},
      {"{", "not JSON"},
      {R"({"schemaVersion":1,"fsLayers":[]})", "schema 1"},
      {R"({"schemaVersion":3})", "must be 2"},
      {R"({"schemaVersion":2,"config":)" + config + R"(,"layers":[]})", "no layers"},
      {R"({"schemaVersion":2,"config":)" + config + R"(,"layers":[)" +
           layer_json("application/vnd.oci.image.layer.v1.tar+xz", kDigestA, 1) + "]}",
       "not a tar, tar+gzip or tar+zstd"},
      {R"({"schemaVersion":2,"config":)" + layer_json("application/vnd.cncf.helm.config.v1+json", kDigestA, 1) +
           R"(,"layers":[]})",
       "not a container image"},
      {R"({"schemaVersion":2,"config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"md5:x",)"
       R"("size":1},"layers":[]})",
       "not a sha256 digest"},
      {R"({"schemaVersion":2,"config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":")" + kDigestA +
           R"(","size":-1},"layers":[]})",
       "non-negative integer"},
      {R"({"schemaVersion":2,"config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":")" + kDigestA +
           R"(","size":1e20},"layers":[]})",
       "non-negative integer"},
      {R"({"schemaVersion":2,"config":)" + config + R"(,"layers":[)" +
           layer_json("application/vnd.oci.image.layer.v1.tar", kDigestA, 1ull << 50) + "]}",
       "beyond any image's size"},
  };
  for (const auto& [body, why] : bad) {
    SCOPED_TRACE(body);
    expect_error([&] { parse_manifest(body, ""); }, Code::kInvalidArgument, {why});
  }
}

TEST(RegistryDocuments, ImageConfigsKeepWhatDockerRunUses) {
  json config{{"architecture", "amd64"},
              {"os", "linux"},
              {"config",
               {{"Env", {"PATH=/opt/conda/bin:/usr/bin", "A=b=c"}},
                {"Entrypoint", {"/bin/sh", "-c"}},
                {"Cmd", {"echo hi"}},
                {"WorkingDir", "/testbed"},
                {"User", "1000:1000"},
                {"ExposedPorts", {{"8080/tcp", json::object()}, {"53/udp", json::object()}}},
                {"Labels", {{"k", "v"}}},
                {"StopSignal", "SIGINT"}}},
              {"rootfs", {{"type", "layers"}, {"diff_ids", {kDigestA, kDigestB}}}}};
  ImageConfigDocument doc = parse_image_config(config.dump());
  EXPECT_EQ(doc.platform.to_string(), "linux/amd64");
  EXPECT_EQ(doc.config.env, (std::vector<std::string>{"PATH=/opt/conda/bin:/usr/bin", "A=b=c"}));
  EXPECT_EQ(doc.config.entrypoint, (std::vector<std::string>{"/bin/sh", "-c"}));
  EXPECT_EQ(doc.config.working_dir, "/testbed");
  EXPECT_EQ(doc.config.user, "1000:1000");
  EXPECT_EQ(doc.config.exposed_ports, (std::vector<std::string>{"53/udp", "8080/tcp"}));
  EXPECT_EQ(doc.config.labels.at("k"), "v");
  EXPECT_EQ(doc.diff_ids.size(), 2u);
  // null members (Docker writes them) are absent ones.
  EXPECT_TRUE(parse_image_config(R"({"config":{"Env":null,"Cmd":null,"Labels":null}})").config.env.empty());
  expect_error([] { parse_image_config(R"({"config":{"Env":["NOEQUALS"]}})"); }, Code::kInvalidArgument,
               {"config.Env", "KEY=value"});
  expect_error([] { parse_image_config(R"({"config":{"WorkingDir":"relative"}})"); }, Code::kInvalidArgument,
               {"config.WorkingDir"});
  expect_error([] { parse_image_config(R"({"config":{"Labels":{"a":1}}})"); }, Code::kInvalidArgument,
               {"config.Labels.a"});
}

TEST(RegistryManifest, TheConfigRoundTripsAsSchemaTwoAndOldManifestsStillRead) {
  Manifest m;
  m.name = "127.0.0.1:5000/team/app";
  m.tag = "v1";
  m.layers.push_back(LayerDescriptor{LayerRole::kBase, kDigestA, 10, kDigestA, kDigestB, 5, 3});
  std::string v1 = manifest_to_json(m);
  EXPECT_EQ(json::parse(v1)["schema"], 1);  // without a config, what older dsec reads
  EXPECT_FALSE(manifest_from_json(v1).config);
  ImageConfig c;
  c.env = {"PATH=/bin"};
  c.working_dir = "/w";
  c.user = "alice";
  c.entrypoint = {"/bin/sh"};
  c.cmd = {"-c", "true"};
  c.exposed_ports = {"80/tcp"};
  c.labels = {{"a", "b"}};
  c.stop_signal = "SIGINT";
  m.config = c;
  std::string v2 = manifest_to_json(m);
  EXPECT_EQ(json::parse(v2)["schema"], 2);
  Manifest back = manifest_from_json(v2);
  ASSERT_TRUE(back.config);
  EXPECT_EQ(*back.config, c);
  EXPECT_EQ(manifest_to_json(back), v2);  // canonical
  json bad = json::parse(v1);
  bad["config"] = {{"env", {"x"}}};
  expect_error([&] { manifest_from_json(bad.dump()); }, Code::kInvalidArgument, {"config", "schema version 2"});
  bad["schema"] = 2;
  expect_error([&] { manifest_from_json(bad.dump()); }, Code::kInvalidArgument, {"config.env", "KEY=value"});
  bad["schema"] = 3;
  expect_error([&] { manifest_from_json(bad.dump()); }, Code::kInvalidArgument, {"1 to 2"});
}

TEST(RegistryCredentials, FlagsDockerConfigAndPrecedence) {
  TempDir dir;
  auto file = dir.path() / "config.json";
  // "alice:pw" and "bob:pw2" in base64; Docker Hub's legacy key.
  write_text(file, R"({"auths":{"reg.example:5000":{"auth":"YWxpY2U6cHc="},)"
                   R"("https://index.docker.io/v1/":{"auth":"Ym9iOnB3Mg=="},)"
                   R"("http://other.io/v2/":{"username":"carol","password":"pw3"}}})");
  Credentials c;
  c.add_flag("other.io=dave:given");
  c.load_docker_config(file);
  EXPECT_EQ(c.find("reg.example:5000")->username, "alice");
  EXPECT_EQ(c.find("reg.example:5000")->password, "pw");
  EXPECT_EQ(c.find("docker.io")->username, "bob");
  EXPECT_EQ(c.find("registry-1.docker.io")->password, "pw2");
  EXPECT_EQ(c.find("other.io")->username, "dave");  // given wins over the file
  EXPECT_FALSE(c.find("nowhere.io"));
  Credentials none;
  none.load_docker_config(dir.path() / "missing.json");  // no file: nothing, no error
  EXPECT_TRUE(none.empty());
  write_text(file, R"({"auths":{"h.io":{"auth":"not base64!"}}})");
  std::string message =
      expect_error([&] { Credentials().load_docker_config(file); }, Code::kInvalidArgument, {"h.io", "base64"});
  expect_error([] { Credentials().add_flag("h.io=nopassword"); }, Code::kInvalidArgument, {"HOST=USER:PASSWORD"});
  std::string secret = expect_error([] { Credentials().add_flag("=u:secret"); }, Code::kInvalidArgument, {});
  EXPECT_EQ(secret.find("secret"), std::string::npos);
}

}  // namespace
}  // namespace dsec::image::registry
