// A client of OCI registries (the OCI distribution spec, as Docker Hub, the CNCF distribution server, Harbor, GHCR,
// ECR and Quay serve it): manifests by tag or digest, image indexes resolved to this platform's image, image
// configurations, and blobs downloaded to files with every byte verified.
//
// Where it connects: HTTPS with the system's CAs (or `ca_file`); plain HTTP only for hosts named insecure and, as
// Docker does, for loopback registries (127.0.0.0/8, localhost, ::1), which are tried over HTTPS first. A mirror of a
// host (`--registry-mirror HOST=URL`) is asked first, the host itself when the mirror fails or lacks the image.
// Docker Hub's name "docker.io" is spoken to at registry-1.docker.io.
//
// Authentication: the first request to a host pings /v2/ and learns its challenge. Bearer (`WWW-Authenticate: Bearer
// realm=...,service=...,scope=...`): a token per repository scope from the realm, anonymous or with the host's
// credentials (credentials.hpp), kept until it expires. Basic: the credentials on every request.
//
// Failures: 429, 5xx and broken or refused connections are retried with backoff (Retry-After honoured, capped), a
// blob download resumes from the bytes it has (Range); a host that wants credentials dsec lacks is UNAUTHENTICATED,
// credentials refused are UNAUTHENTICATED, 403 is PERMISSION_DENIED, a missing repository, tag or blob NOT_FOUND,
// each naming the registry, repository and tag; bytes that do not match their digest or size are
// FAILED_PRECONDITION (the registry's copy is broken: a fault of the registry, not of dsec's data, so never a 500);
// what cannot be reached after the retries is UNAVAILABLE. Redirects are followed for blobs only, at most 3, to HTTPS
// or within the registry's own host, never carrying the registry's credentials elsewhere.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "image/registry/credentials.hpp"
#include "image/registry/oci_image.hpp"
#include "image/store/manifest.hpp"

namespace dsec::image::registry {

struct RegistryOptions {
  Credentials credentials;
  std::vector<std::string> insecure;           // hosts ("h:5000") spoken to over plain HTTP when HTTPS fails
  std::map<std::string, std::string> mirrors;  // registry host -> a mirror's base URL, asked first
  std::string ca_file;                         // a CA bundle to trust instead of the system's
  Platform platform{"linux", "amd64", ""};     // the image picked from an index
  std::chrono::milliseconds connect_timeout{5000};
  // A transfer that moves less than 1 KiB/s for this long is cut (and retried); small requests also end after it.
  std::chrono::milliseconds stall_timeout{30000};
  int attempts = 5;  // per request, on 429, 5xx and broken connections
  std::chrono::milliseconds max_backoff{5000};
};

// "HOST=URL": a mirror (the flags' form). INVALID_ARGUMENT otherwise.
void add_mirror(RegistryOptions& options, std::string_view flag);

// The registry settings as the programs' flags give them (dsecd, dsec, the client's options).
struct RegistryFlags {
  std::vector<std::string> auth;      // "HOST=USER:PASSWORD"
  std::string auth_file;              // a file of such lines (keeps passwords off command lines)
  std::vector<std::string> mirrors;   // "HOST=URL"
  std::vector<std::string> insecure;  // "HOST"
  std::string ca_file;
  std::string platform;                   // "linux/amd64" when empty
  std::string docker_config = "default";  // Docker's config.json to read credentials from; "default": the usual
                                          // place (Credentials::default_docker_config), empty: none
};
// INVALID_ARGUMENT naming the flag for a malformed value.
RegistryOptions registry_options(const RegistryFlags& flags);
// A name of dsec's stores under the operator's default registry, as Docker expands names: with "docker.io",
// "python:3.12" is "docker.io/library/python:3.12" and "swe/task" "docker.io/swe/task"; with any other host H,
// "H/NAME". A reference that names a registry already is returned as it is.
ImageReference with_default_registry(const ImageReference& ref, std::string_view default_registry);

struct RegistryImage {
  ImageReference reference;     // as asked, with the digest its tag names (an index's, or the image manifest's)
  std::string manifest_digest;  // the image manifest's (this platform's, when the tag names an index)
  ManifestDocument manifest;
  std::string config_json;
  ImageConfigDocument config;
  // "registry <host>/<repository>@<digest the tag named>": where the image came from, for dsec's manifest.
  std::string source() const;
};

// Cancellation: checked while bytes flow; true stops the transfer with CANCELLED.
using CancelFn = std::function<bool()>;

class RegistryClient {
 public:
  explicit RegistryClient(RegistryOptions options);
  ~RegistryClient();
  RegistryClient(const RegistryClient&) = delete;
  RegistryClient& operator=(const RegistryClient&) = delete;

  // The image a reference names, for options.platform: its manifest and configuration. An index with no image for
  // the platform is NOT_FOUND listing the platforms it has.
  RegistryImage fetch_image(const ImageReference& ref, const CancelFn& cancelled = {});
  // The digest the reference's tag names now (HEAD), to tell whether an imported tag moved.
  std::string tag_digest(const ImageReference& ref);
  // Downloads a blob of the reference's repository into `file`, resuming from the bytes the file holds (a file
  // from an earlier, cut download) and checking size and digest: FAILED_PRECONDITION (and the file removed) when
  // they differ.
  // `progress` gets the bytes received so far. Returns the bytes received over the network.
  std::uint64_t download_blob(const ImageReference& ref, const Descriptor& blob, const std::filesystem::path& file,
                              const std::function<void(std::uint64_t)>& progress = {}, const CancelFn& cancelled = {});

  const RegistryOptions& options() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsec::image::registry
