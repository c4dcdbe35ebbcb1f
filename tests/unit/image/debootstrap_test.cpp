// How the debootstrap builder finds this machine's Debian mirror, names its cache and cleans a tree.
#include <sys/stat.h>

#include <gtest/gtest.h>

#include "dsec/error.hpp"
#include "image/debootstrap.hpp"
#include "image/image_test_util.hpp"

namespace dsec::image {
namespace {

namespace fs = std::filesystem;
using testing::read_text;
using testing::TempDir;
using testing::write_text;

constexpr const char* kDebianSources = R"(Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
)";

TEST(AptSources, ParsesDeb822Paragraphs) {
  auto sources = parse_deb822_sources(kDebianSources);
  ASSERT_EQ(sources.size(), 2u);
  EXPECT_EQ(sources[0].types, std::vector<std::string>{"deb"});
  EXPECT_EQ(sources[0].uris, std::vector<std::string>{"http://deb.debian.org/debian"});
  EXPECT_EQ(sources[0].suites, (std::vector<std::string>{"bookworm", "bookworm-updates"}));
  EXPECT_EQ(sources[1].suites, std::vector<std::string>{"bookworm-security"});
}

TEST(AptSources, Deb822SkipsDisabledAndJoinsContinuationLines) {
  auto sources = parse_deb822_sources(
      "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\nEnabled: no\n\n"
      "types: deb deb-src\nuris: http://a.example/debian\n  http://b.example/debian\nsuites: trixie\n");
  ASSERT_EQ(sources.size(), 1u);
  EXPECT_EQ(sources[0].types, (std::vector<std::string>{"deb", "deb-src"}));
  EXPECT_EQ(sources[0].uris, (std::vector<std::string>{"http://a.example/debian", "http://b.example/debian"}));
}

TEST(AptSources, ParsesOneLineEntriesWithOptions) {
  auto sources = parse_one_line_sources(
      "# comment\n"
      "deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] http://mirror.example/debian/ bookworm main contrib\n"
      "deb-src http://src.example/debian bookworm main\n"
      "deb [trusted=yes] file:/srv/repo ./\n"
      "garbage\n");
  ASSERT_EQ(sources.size(), 3u);
  EXPECT_EQ(sources[0].uris[0], "http://mirror.example/debian/");
  EXPECT_EQ(sources[0].suites[0], "bookworm");
  EXPECT_EQ(sources[0].components, (std::vector<std::string>{"main", "contrib"}));
  EXPECT_EQ(sources[1].types[0], "deb-src");
  EXPECT_EQ(sources[2].uris[0], "file:/srv/repo");
}

TEST(AptSources, PicksTheArchiveThatListsTheSuiteAndNeverTheSecurityOne) {
  auto sources = parse_deb822_sources(kDebianSources);
  EXPECT_EQ(pick_debian_mirror(sources, "bookworm"), "http://deb.debian.org/debian");
  // A suite no source lists falls back to the main archive, not the security one.
  EXPECT_EQ(pick_debian_mirror(sources, "trixie"), "http://deb.debian.org/debian");

  auto mixed = parse_one_line_sources(
      "deb http://security.debian.org/debian-security bookworm-security main\n"
      "deb-src http://src.example/debian bookworm main\n"
      "deb cdrom:[Debian]/ bookworm main\n"
      "deb http://old.example/debian bullseye main\n"
      "deb https://new.example/debian/ bookworm main\n");
  EXPECT_EQ(pick_debian_mirror(mixed, "bookworm"), "https://new.example/debian");
  EXPECT_EQ(pick_debian_mirror(mixed, "bullseye"), "http://old.example/debian");
  EXPECT_EQ(pick_debian_mirror({}, "bookworm"), "");
}

TEST(AptSources, FindsTheMirrorInAnAptDirectory) {
  TempDir tmp;
  write_text(tmp / "apt/sources.list.d/debian.sources", kDebianSources);
  write_text(tmp / "apt/sources.list.d/vendor.list.disabled", "deb http://vendor.example/apt stable main\n");
  EXPECT_EQ(find_debian_mirror("bookworm", tmp / "apt"), "http://deb.debian.org/debian");

  write_text(tmp / "apt/sources.list", "deb http://first.example/debian bookworm main\n");
  EXPECT_EQ(find_debian_mirror("bookworm", tmp / "apt"), "http://first.example/debian");

  TempDir empty;
  try {
    find_debian_mirror("bookworm", empty.path());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("--mirror"), std::string::npos) << e.what();
  }
}

TEST(Debootstrap, PackagesAreCheckedSortedAndDeduplicated) {
  EXPECT_EQ(normalize_packages({"python3", " git ", "python3", "", "g++", "libc6-dev", "python3.11"}),
            (std::vector<std::string>{"g++", "git", "libc6-dev", "python3", "python3.11"}));
  for (const std::string bad : {"Python3", "a", "py thon", "python3,git", "-rf", "pkg;rm", "x:amd64"})
    EXPECT_THROW(normalize_packages({bad}), Error) << bad;
}

TEST(Debootstrap, CacheNameNamesSuiteArchAndPackages) {
  EXPECT_EQ(debootstrap_cache_name("bookworm", "amd64", {}), "debootstrap-bookworm-amd64-minbase-slim.tar.zst");
  EXPECT_EQ(debootstrap_cache_name("bookworm", "amd64", {"git", "python3"}),
            "debootstrap-bookworm-amd64-minbase-slim+git+python3.tar.zst");
  std::vector<std::string> many;
  for (int i = 0; i < 30; ++i) many.push_back("package-" + std::to_string(i));
  std::string a = debootstrap_cache_name("bookworm", "amd64", many);
  EXPECT_LT(a.size(), 140u);
  many.back() = "package-other";
  EXPECT_NE(debootstrap_cache_name("bookworm", "amd64", many), a) << "different package lists share a cache";
}

TEST(Debootstrap, CleanTakesOutCachesLogsAndHostFiles) {
  TempDir tmp;
  const fs::path root = tmp / "rootfs";
  write_text(root / "var/cache/apt/archives/python3_3.11_amd64.deb", std::string(4096, 'd'));
  fs::create_directories(root / "var/cache/apt/archives/partial");
  write_text(root / "var/cache/apt/pkgcache.bin", "bin");
  write_text(root / "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease", "lists");
  write_text(root / "var/log/apt/history.log", "log");
  write_text(root / "var/log/bootstrap.log", "log");
  write_text(root / "tmp/junk", "junk");
  write_text(root / "etc/hostname", "build-host\n");
  write_text(root / "etc/resolv.conf", "nameserver 10.0.0.1\n");
  write_text(root / "etc/hosts", "203.0.113.80 deb.debian.org\n");
  write_text(root / "var/lib/dpkg/status", "keep");
  write_text(root / "var/lib/dpkg/status-old", "old");
  write_text(root / "usr/bin/python3", "keep", 0755);
  write_text(root / "usr/share/doc/python3/copyright", "license");
  write_text(root / "usr/share/doc/python3/changelog.Debian.gz", std::string(1000, 'c'));
  fs::create_symlink("python3", root / "usr/share/doc/python3-minimal");
  write_text(root / "usr/share/man/man1/python3.1.gz", "man");
  write_text(root / "usr/share/locale/de/LC_MESSAGES/apt.mo", "de");
  write_text(root / "usr/share/locale/locale.alias", "alias");
  fs::create_directories(root / "dev");
  fs::create_symlink("/proc/self/fd", root / "dev/fd");

  std::vector<std::string> notes;
  clean_debootstrap_tree(root, notes);
  EXPECT_FALSE(fs::exists(root / "var/cache/apt/archives/python3_3.11_amd64.deb"));
  EXPECT_TRUE(fs::is_directory(root / "var/cache/apt/archives/partial"));
  EXPECT_FALSE(fs::exists(root / "var/cache/apt/pkgcache.bin"));
  EXPECT_FALSE(fs::exists(root / "var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease"));
  EXPECT_FALSE(fs::exists(root / "var/log/apt/history.log"));
  EXPECT_TRUE(fs::is_directory(root / "var/log/apt"));
  EXPECT_FALSE(fs::exists(root / "tmp/junk"));
  EXPECT_EQ(testing::lstat_of(root / "tmp").st_mode & 07777, 01777u);
  EXPECT_EQ(read_text(root / "etc/hostname"), "");
  EXPECT_EQ(read_text(root / "etc/resolv.conf"), "");
  EXPECT_EQ(read_text(root / "etc/hosts").find("203.0.113.80"), std::string::npos);
  EXPECT_NE(read_text(root / "etc/hosts").find("localhost"), std::string::npos);
  EXPECT_EQ(read_text(root / "var/lib/dpkg/status"), "keep");
  EXPECT_FALSE(fs::exists(root / "var/lib/dpkg/status-old"));
  EXPECT_EQ(read_text(root / "usr/bin/python3"), "keep");
  EXPECT_TRUE(fs::is_empty(root / "dev"));
  EXPECT_EQ(read_text(root / "usr/share/doc/python3/copyright"), "license");
  EXPECT_FALSE(fs::exists(root / "usr/share/doc/python3/changelog.Debian.gz"));
  EXPECT_TRUE(fs::is_symlink(root / "usr/share/doc/python3-minimal"));
  EXPECT_TRUE(fs::is_empty(root / "usr/share/man"));
  EXPECT_FALSE(fs::exists(root / "usr/share/locale/de"));
  EXPECT_EQ(read_text(root / "usr/share/locale/locale.alias"), "alias");
  EXPECT_NE(read_text(root / "etc/dpkg/dpkg.cfg.d/dsec-slim").find("path-exclude /usr/share/man/*"), std::string::npos);
  for (const char* d : {"proc", "sys", "run"}) EXPECT_TRUE(fs::is_directory(root / d)) << d;
  ASSERT_FALSE(notes.empty());
  EXPECT_NE(notes[0].find("MiB"), std::string::npos);
}

}  // namespace
}  // namespace dsec::image
