// The null backend: nothing runs, files live in memory, tar streams go both ways.
#include <gtest/gtest.h>

#include <archive.h>
#include <archive_entry.h>

#include <functional>
#include <map>

#include "agent/backends/null/null_backend.hpp"
#include "dsec/error.hpp"
#include "error_test_util.hpp"

namespace dsec::agent {
namespace {

struct TarEntry {
  std::string name;
  std::string data;
  unsigned type = AE_IFREG;
  unsigned mode = 0644;
};

std::string make_tar(const std::vector<TarEntry>& entries) {
  std::string out;
  archive* a = archive_write_new();
  archive_write_set_format_pax_restricted(a);
  archive_write_set_bytes_in_last_block(a, 1);
  archive_write_open(
      a, &out, nullptr,
      [](archive*, void* ctx, const void* buf, size_t n) -> la_ssize_t {
        static_cast<std::string*>(ctx)->append(static_cast<const char*>(buf), n);
        return static_cast<la_ssize_t>(n);
      },
      nullptr);
  for (const auto& e : entries) {
    archive_entry* entry = archive_entry_new();
    archive_entry_set_pathname(entry, e.name.c_str());
    archive_entry_set_filetype(entry, e.type);
    archive_entry_set_perm(entry, e.mode);
    if (e.type == AE_IFLNK) archive_entry_set_symlink(entry, e.data.c_str());
    archive_entry_set_size(entry, e.type == AE_IFREG ? static_cast<la_int64_t>(e.data.size()) : 0);
    archive_write_header(a, entry);
    if (e.type == AE_IFREG) archive_write_data(a, e.data.data(), e.data.size());
    archive_entry_free(entry);
  }
  archive_write_close(a);
  archive_write_free(a);
  return out;
}

// name -> (data, mode, is_dir)
std::map<std::string, std::tuple<std::string, unsigned, bool>> read_tar(const std::string& tar) {
  std::map<std::string, std::tuple<std::string, unsigned, bool>> out;
  archive* a = archive_read_new();
  archive_read_support_format_tar(a);
  EXPECT_EQ(archive_read_open_memory(a, tar.data(), tar.size()), ARCHIVE_OK);
  archive_entry* entry;
  while (archive_read_next_header(a, &entry) == ARCHIVE_OK) {
    std::string data;
    char buf[4096];
    for (la_ssize_t n; (n = archive_read_data(a, buf, sizeof buf)) > 0;) data.append(buf, static_cast<size_t>(n));
    out[archive_entry_pathname(entry)] = {data, archive_entry_perm(entry), archive_entry_filetype(entry) == AE_IFDIR};
  }
  archive_read_free(a);
  return out;
}

class NullBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CreateParams params;
    params.id = "n1-000000000001";
    params.spec.kind = "null";
    params.spec.resources.disk_bytes = 1 << 20;
    sandbox_ = backend_->create(params);
  }
  std::unique_ptr<Backend> backend_ = make_null_backend();
  std::unique_ptr<BackendSandbox> sandbox_;
};

TEST_F(NullBackendTest, ItsKindIsNullAndExecRunsNothing) {
  EXPECT_EQ(backend_->kind(), "null");
  ExecRequest r;
  r.argv = {"true"};
  try {
    sandbox_->exec(r);
    FAIL() << "the null backend ran something";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnimplemented);
    EXPECT_EQ(std::string(e.what()), "the null backend runs nothing; it simulates the control plane");
  }
  EXPECT_TRUE(sandbox_->alive());
}

TEST_F(NullBackendTest, FilesKeepEveryByteAndMakeTheirParents) {
  std::string binary("\0\x01\xff\r\n\0end", 9);
  sandbox_->write_file("/work/deep/data.bin", binary, 0600);
  EXPECT_EQ(sandbox_->read_file("/work/deep/data.bin"), binary);
  EXPECT_EQ(sandbox_->read_file("/work/./x/../deep//data.bin"), binary);
  EXPECT_TRUE(sandbox_->is_directory("/work/deep"));
  EXPECT_TRUE(sandbox_->is_directory("/"));
  EXPECT_FALSE(sandbox_->is_directory("/work/deep/data.bin"));
  EXPECT_FALSE(sandbox_->is_directory("/nothing"));
  sandbox_->write_file("/work/deep/data.bin", "short", 0644);
  EXPECT_EQ(sandbox_->read_file("/work/deep/data.bin"), "short");
  // ".." stops at the sandbox's root.
  sandbox_->write_file("/../../etc/x", "inside", 0644);
  EXPECT_EQ(sandbox_->read_file("/etc/x"), "inside");
}

TEST_F(NullBackendTest, FileErrorsHaveTheirCodes) {
  sandbox_->write_file("/f", "x", 0644);
  EXPECT_CODE(sandbox_->read_file("/missing"), Code::kNotFound);
  EXPECT_CODE(sandbox_->read_file("/"), Code::kInvalidArgument);
  EXPECT_CODE(sandbox_->write_file("/f/child", "x", 0644), Code::kInvalidArgument);
  EXPECT_CODE(sandbox_->write_file("relative", "x", 0644), Code::kInvalidArgument);
  EXPECT_CODE(sandbox_->get_archive("/f"), Code::kInvalidArgument);
  EXPECT_CODE(sandbox_->get_archive("/missing"), Code::kNotFound);
}

TEST_F(NullBackendTest, TheDiskLimitHolds) {
  std::string half(600 << 10, 'a');
  sandbox_->write_file("/a", half, 0644);
  EXPECT_CODE(sandbox_->write_file("/b", half, 0644), Code::kResourceExhausted);
  sandbox_->write_file("/a", "", 0644);  // freeing space makes room again
  sandbox_->write_file("/b", half, 0644);
}

TEST_F(NullBackendTest, TarStreamsRoundTrip) {
  std::string binary("\0tar\xfe", 5);
  sandbox_->put_archive("/src", make_tar({{"pkg/", "", AE_IFDIR, 0750},
                                          {"pkg/mod.py", "print(1)\n", AE_IFREG, 0644},
                                          {"./run.sh", "#!/bin/sh\n", AE_IFREG, 0755},
                                          {"blob", binary, AE_IFREG, 0600}}));
  EXPECT_EQ(sandbox_->read_file("/src/pkg/mod.py"), "print(1)\n");
  EXPECT_EQ(sandbox_->read_file("/src/blob"), binary);
  auto entries = read_tar(sandbox_->get_archive("/src"));
  ASSERT_EQ(entries.size(), 4u);
  EXPECT_EQ(std::get<0>(entries.at("pkg/mod.py")), "print(1)\n");
  EXPECT_EQ(std::get<1>(entries.at("run.sh")), 0755u);
  EXPECT_EQ(std::get<0>(entries.at("blob")), binary);
  EXPECT_TRUE(std::get<2>(entries.at("pkg/")));
  EXPECT_EQ(std::get<1>(entries.at("pkg/")), 0750u);
  // The whole root as a tar holds the same files under src/.
  EXPECT_EQ(std::get<0>(read_tar(sandbox_->get_archive("/")).at("src/pkg/mod.py")), "print(1)\n");
}

TEST_F(NullBackendTest, TarEntriesCannotLeaveTheirDirectory) {
  EXPECT_CODE(sandbox_->put_archive("/src", make_tar({{"../escape", "x"}})), Code::kInvalidArgument);
  EXPECT_CODE(sandbox_->read_file("/escape"), Code::kNotFound);
  EXPECT_CODE(sandbox_->put_archive("/src", make_tar({{"link", "/etc/passwd", AE_IFLNK}})), Code::kInvalidArgument);
  EXPECT_CODE(sandbox_->put_archive("/src", "this is not a tar stream at all, not even close......"),
              Code::kInvalidArgument);
}

TEST_F(NullBackendTest, DestroyEndsEverything) {
  sandbox_->write_file("/a", "x", 0644);
  sandbox_->destroy();
  sandbox_->destroy();  // idempotent
  EXPECT_FALSE(sandbox_->alive());
  EXPECT_CODE(sandbox_->read_file("/a"), Code::kNotFound);
  EXPECT_CODE(sandbox_->write_file("/a", "x", 0644), Code::kNotFound);
}

}  // namespace
}  // namespace dsec::agent
