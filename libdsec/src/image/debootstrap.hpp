// Pieces of the debootstrap builder that tests reach directly: reading apt's sources to find the Debian mirror this
// machine uses, the cache key of a tree, and the clean-up that keeps an image small.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::image {

// One entry of apt's sources, from either format.
struct AptSource {
  std::vector<std::string> types;  // "deb", "deb-src"
  std::vector<std::string> uris;
  std::vector<std::string> suites;
  std::vector<std::string> components;
};

// "deb [opts] URI SUITE COMPONENT..." lines (sources.list, *.list).
std::vector<AptSource> parse_one_line_sources(std::string_view text);
// deb822 paragraphs (*.sources); "Enabled: no" paragraphs are left out.
std::vector<AptSource> parse_deb822_sources(std::string_view text);

// The archive to bootstrap `suite` from: the first binary ("deb") http(s)/file source that lists the suite, else the
// first one that is not a security archive. Empty when there is none. Trailing '/' removed.
std::string pick_debian_mirror(const std::vector<AptSource>& sources, std::string_view suite);
// pick_debian_mirror over <apt_dir>/sources.list and <apt_dir>/sources.list.d/*.list and *.sources, in apt's order.
// FAILED_PRECONDITION naming the files read when none fits.
std::string find_debian_mirror(std::string_view suite, const std::filesystem::path& apt_dir = "/etc/apt");

// Debian package names, checked (INVALID_ARGUMENT for anything debootstrap would misread), sorted, deduplicated.
std::vector<std::string> normalize_packages(const std::vector<std::string>& packages);
// "debootstrap-bookworm-amd64-minbase-slim+python3.tar.zst"; long package lists are shortened with a hash.
std::string debootstrap_cache_name(std::string_view suite, std::string_view arch,
                                   const std::vector<std::string>& normalized_packages);
// The Debian architecture name of this machine ("amd64", "arm64", ...).
std::string host_debian_arch();

// Takes out of a fresh debootstrap tree what an image should not carry: apt's downloaded packages and lists, logs,
// /tmp contents, documentation (but copyright files), manual pages and translations (and tells dpkg to leave them
// out of later installs too), device nodes in /dev (a sandbox gets its own), and the host's /etc/hostname,
// /etc/resolv.conf and /etc/hosts that debootstrap copied in (replaced by neutral placeholders). Appends what it did
// to `notes`.
void clean_debootstrap_tree(const std::filesystem::path& rootfs, std::vector<std::string>& notes);

}  // namespace dsec::image
