// Who an exec runs as (agent/exec_user) and the fields that carry it.
//
// ExecUser: the resolver over the text of a sandbox's /etc/passwd and /etc/group: names, a uid, uid:gid, group
// membership, a missing name, ids out of range, garbage, and hostile database lines (too few or many fields, ids that
// are not numbers, NIS lines, NUL bytes, CRLF, comments) that are skipped; the glue that picks the request's user or
// the spec's and reads the two files; exec_command's HOME, USER and LOGNAME.
// ExecUserProtocol: the JSON fields (`user` of a spec and of an exec, `protected_paths`) are decoded, validated with
// the field named, round trip, and are left out of a spec that does not set them.
// ExecUserWire: the user part of dsec-init's start payload and of the guest's kExec frame.
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "agent/backends/command/exec_command.hpp"
#include "agent/backends/command/exec_user.hpp"
#include "common/protocol.hpp"
#include "common/wire/guest_protocol.hpp"
#include "common/wire/init_protocol.hpp"
#include "dsec/error.hpp"

namespace dsec {
namespace {

using agent::ExecUser;
using agent::resolve_exec_user;
using protocol::json;

constexpr const char* kPasswd =
    "root:x:0:0:root:/root:/bin/sh\n"
    "alice:x:1001:1001:Alice:/home/alice:/bin/sh\n"
    "bob:x:1002:100::/home/bob:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n";
constexpr const char* kGroup =
    "root:x:0:\n"
    "users:x:100:\n"
    "alice:x:1001:\n"
    "staff:x:50:bob,alice\n"
    "dev:x:60: carol , alice \n"
    "lookalike:x:70:alicex,xalice\n"
    "wheel:x:10:root\n";

// The error `fn` throws; fails the test when it throws none or another type.
template <typename F>
Error error_of(F&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-dsec exception: " << e.what();
    return Error(Code::kInternal, e.what());
  }
  ADD_FAILURE() << "threw nothing";
  return Error(Code::kOk, "");
}

void expect_invalid(const std::string& user, const std::string& fragment, const char* passwd = kPasswd) {
  Error e = error_of([&] { resolve_exec_user(user, passwd, kGroup); });
  EXPECT_EQ(e.code(), Code::kInvalidArgument) << user;
  std::string what = e.what();
  EXPECT_EQ(what.rfind("user: ", 0), 0u) << "the field is named first: " << what;
  EXPECT_NE(what.find(fragment), std::string::npos) << "'" << fragment << "' not in: " << what;
}

TEST(ExecUser, EmptyIsRootAsBeforeWithoutAnyLookup) {
  ExecUser u = resolve_exec_user("", "", "");
  EXPECT_FALSE(u.named);
  EXPECT_EQ(u.uid, 0u);
  EXPECT_EQ(u.gid, 0u);
  EXPECT_TRUE(u.groups.empty());
}

TEST(ExecUser, NameTakesItsEntryAndEveryGroupThatListsIt) {
  ExecUser u = resolve_exec_user("alice", kPasswd, kGroup);
  EXPECT_TRUE(u.named);
  EXPECT_EQ(u.uid, 1001u);
  EXPECT_EQ(u.gid, 1001u);
  // The primary group first, then /etc/group's memberships in file order; members are matched whole (not "alicex").
  EXPECT_EQ(u.groups, (std::vector<std::uint32_t>{1001, 50, 60}));
  EXPECT_EQ(u.name, "alice");
  EXPECT_EQ(u.home, "/home/alice");

  ExecUser b = resolve_exec_user("bob", kPasswd, kGroup);
  EXPECT_EQ(b.gid, 100u);
  EXPECT_EQ(b.groups, (std::vector<std::uint32_t>{100, 50}));

  ExecUser r = resolve_exec_user("root", kPasswd, kGroup);
  EXPECT_TRUE(r.named);
  EXPECT_EQ(r.uid, 0u);
  EXPECT_EQ(r.groups, (std::vector<std::uint32_t>{0, 10}));
  EXPECT_EQ(r.home, "/root");
}

TEST(ExecUser, NumericUidUsesItsEntryWhereItHasOne) {
  ExecUser u = resolve_exec_user("1001", kPasswd, kGroup);
  EXPECT_EQ(u.uid, 1001u);
  EXPECT_EQ(u.gid, 1001u);
  EXPECT_EQ(u.groups, (std::vector<std::uint32_t>{1001, 50, 60}));
  EXPECT_EQ(u.name, "alice");
  EXPECT_EQ(u.home, "/home/alice");

  ExecUser n = resolve_exec_user("65534", kPasswd, kGroup);
  EXPECT_EQ(n.name, "nobody");
  EXPECT_EQ(n.gid, 65534u);
}

TEST(ExecUser, NumericUidWithoutAnEntryRunsWithItsOwnGidAndNoOtherGroup) {
  ExecUser u = resolve_exec_user("1000", kPasswd, kGroup);
  EXPECT_TRUE(u.named);
  EXPECT_EQ(u.uid, 1000u);
  EXPECT_EQ(u.gid, 1000u);
  EXPECT_EQ(u.groups, (std::vector<std::uint32_t>{1000}));
  EXPECT_EQ(u.name, "");
  EXPECT_EQ(u.home, "/");
  // Also with no /etc/passwd at all.
  ExecUser v = resolve_exec_user("0", "", "");
  EXPECT_EQ(v.uid, 0u);
  EXPECT_EQ(v.gid, 0u);
  EXPECT_EQ(v.home, "/");
}

TEST(ExecUser, UidColonGidOverridesThePrimaryGroup) {
  ExecUser u = resolve_exec_user("1000:1000", kPasswd, kGroup);
  EXPECT_EQ(u.uid, 1000u);
  EXPECT_EQ(u.gid, 1000u);
  EXPECT_EQ(u.groups, (std::vector<std::uint32_t>{1000}));
  EXPECT_EQ(u.home, "/");

  // alice's uid with another gid: that gid first, her memberships after it, her home.
  ExecUser a = resolve_exec_user("1001:50", kPasswd, kGroup);
  EXPECT_EQ(a.gid, 50u);
  EXPECT_EQ(a.groups, (std::vector<std::uint32_t>{50, 60}));
  EXPECT_EQ(a.home, "/home/alice");

  ExecUser z = resolve_exec_user("0:0", kPasswd, kGroup);
  EXPECT_EQ(z.uid, 0u);
  EXPECT_EQ(z.gid, 0u);
}

TEST(ExecUser, AMissingNameIsInvalidArgumentNamingIt) {
  expect_invalid("mallory", "'mallory' is not a user of this sandbox");
  // A sandbox without /etc/passwd has no names at all.
  expect_invalid("alice", "'alice'", "");
  // Names are exact: case and prefixes do not match.
  expect_invalid("Alice", "'Alice'");
  expect_invalid("alic", "'alic'");
}

TEST(ExecUser, IdsOutOfRangeAreInvalidArgument) {
  expect_invalid("65536", "out of range");
  expect_invalid("4294967295", "out of range");
  expect_invalid("99999999999999999999999", "out of range");
  expect_invalid("1:65536", "gid 65536 is out of range");
  expect_invalid("65536:1", "uid 65536 is out of range");
  EXPECT_EQ(resolve_exec_user("65535:65535", kPasswd, kGroup).uid, 65535u);
  // A name whose entry has an id dsec cannot run as.
  expect_invalid("big", "dsec runs commands as ids 0 to 65535", "big:x:70000:1:::/bin/sh\n");
  expect_invalid("biggid", "gid 70000", "biggid:x:1:70000:::/bin/sh\n");
}

TEST(ExecUser, GarbageIsInvalidArgument) {
  for (const char* bad : {"1:", ":1", ":", "a:b", "1:2:3", "1:x", "-1", "-rf", "bob smith", "a/b", "a;b", "$", "x\ny",
                          "uid=0", " 1", "1 ", "+1", "0x10", "é"})
    expect_invalid(bad, "user: '");
  expect_invalid(std::string(65, 'a'), "not a user name");
  expect_invalid(std::string("a\0b", 3), "(contains NUL)");
  // Names with the characters real systems use pass the form check (and then need an entry).
  for (const char* ok : {"www-data", "_apt", "systemd-network", "user.name", "machine$", "a1"}) {
    std::string passwd = std::string(ok) + ":x:2000:2000::/:/bin/sh\n";
    EXPECT_EQ(resolve_exec_user(ok, passwd, "").uid, 2000u) << ok;
  }
}

TEST(ExecUser, HostileDatabaseLinesAreSkipped) {
  const std::string passwd = std::string(
                                 "# alice:x:0:0:comment:/root:/bin/sh\n"
                                 "alice:x:0\n"                       // too few fields
                                 "alice:x:0:0:::/bin/sh:extra\n"     // too many
                                 "alice:x:abc:0:::/bin/sh\n"         // uid not a number
                                 "alice:x:-1:0:::/bin/sh\n"          // negative
                                 "alice:x: 0:0:::/bin/sh\n"          // space
                                 "alice:x:4294967296:0:::/bin/sh\n"  // past 32 bits
                                 "alice:x::0:::/bin/sh\n"            // empty uid
                                 "+alice::0:0:::\n"                  // NIS compat
                                 "-alice::0:0:::\n"
                                 ":x:0:0:::/bin/sh\n") +                             // no name
                             std::string("alice:x:0:0:nul\0:/root:/bin/sh\n", 31) +  // a NUL byte
                             "\n\n"
                             "alice:x:1001:1001:Alice:/home/alice:/bin/sh\r\n"  // the real one, CRLF
                             "alice:x:0:0:later duplicate:/root:/bin/sh\n";     // the first well-formed entry wins
  const std::string group =
      "staff:x:50:alice\n"
      "huge:x:70000:alice\n"  // a gid out of range: skipped
      "bad:x:nope:alice\n"    // not a number
      "short:x:51\n"          // too few fields
      "+nis:x:52:alice\n"
      "staff:x:50:alice\n"  // the same gid twice: once
      "ok:x:53:alice";      // no final newline
  ExecUser u = resolve_exec_user("alice", passwd, group);
  EXPECT_EQ(u.uid, 1001u);
  EXPECT_EQ(u.gid, 1001u);
  EXPECT_EQ(u.home, "/home/alice");
  EXPECT_EQ(u.groups, (std::vector<std::uint32_t>{1001, 50, 53}));
  // A name that only malformed lines carry is not a user.
  expect_invalid("mallory", "'mallory'", "mallory:x:0\n+mallory::0:0:::\nmallory:x:x:0:::\n");
}

TEST(ExecUser, AnEmptyHomeIsTheRoot) {
  ExecUser u = resolve_exec_user("svc", "svc:x:300:300:::/bin/false\n", "");
  EXPECT_EQ(u.home, "/");
  EXPECT_EQ(u.name, "svc");
}

TEST(ExecUser, MoreGroupsThanTheLimitIsInvalidArgument) {
  std::string group;
  for (std::size_t i = 0; i <= agent::kMaxExecGroups; ++i)
    group += "g" + std::to_string(i) + ":x:" + std::to_string(2000 + i) + ":alice\n";
  Error e = error_of([&] { resolve_exec_user("alice", kPasswd, group); });
  EXPECT_EQ(e.code(), Code::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("more than 256 groups"), std::string::npos) << e.what();
}

TEST(ExecUser, TheRequestsUserOverridesTheSpecsAndFilesAreReadOnlyForANamedUser) {
  int reads = 0;
  agent::SandboxFileReader read = [&](const std::string& path) -> std::optional<std::string> {
    ++reads;
    if (path == "/etc/passwd") return std::string(kPasswd);
    if (path == "/etc/group") return std::string(kGroup);
    ADD_FAILURE() << "read " << path;
    return std::nullopt;
  };
  SandboxSpec spec;
  ExecRequest req;
  EXPECT_FALSE(resolve_exec_user(spec, req, read).named);
  EXPECT_EQ(reads, 0);
  spec.user = "alice";
  EXPECT_EQ(resolve_exec_user(spec, req, read).uid, 1001u);
  EXPECT_EQ(reads, 2);
  req.user = "root";
  ExecUser r = resolve_exec_user(spec, req, read);
  EXPECT_TRUE(r.named);
  EXPECT_EQ(r.uid, 0u);
  req.user = "0:0";
  EXPECT_EQ(resolve_exec_user(spec, req, read).uid, 0u);
  // A bad form is refused before anything is read.
  reads = 0;
  req.user = "no such:user";
  EXPECT_EQ(error_of([&] { resolve_exec_user(spec, req, read); }).code(), Code::kInvalidArgument);
  EXPECT_EQ(reads, 0);
}

TEST(ExecUser, MissingDatabaseFilesAreEmptyAndOtherReadErrorsKeepTheirCode) {
  agent::SandboxFileReader missing = [](const std::string&) -> std::optional<std::string> { return std::nullopt; };
  SandboxSpec spec;
  ExecRequest req;
  req.user = "1000";
  ExecUser u = resolve_exec_user(spec, req, missing);
  EXPECT_EQ(u.uid, 1000u);
  EXPECT_EQ(u.home, "/");
  req.user = "alice";
  EXPECT_EQ(error_of([&] { resolve_exec_user(spec, req, missing); }).code(), Code::kInvalidArgument);

  agent::SandboxFileReader too_big = [](const std::string& path) -> std::optional<std::string> {
    throw Error(Code::kResourceExhausted, "read " + path + ": larger than the limit");
  };
  Error e = error_of([&] { resolve_exec_user(spec, req, too_big); });
  EXPECT_EQ(e.code(), Code::kResourceExhausted);
  EXPECT_NE(std::string(e.what()).find("user: 'alice': reading the sandbox's /etc/passwd"), std::string::npos)
      << e.what();
}

TEST(ExecUser, ExecCommandSetsHomeUserAndLognameUnlessEnvDoes) {
  SandboxSpec spec;
  ExecRequest req;
  req.argv = {"id"};
  auto root = agent::exec_command(spec, req, "h");
  EXPECT_FALSE(root.named_user);
  EXPECT_EQ(root.env.at("HOME"), "/root");
  EXPECT_EQ(root.env.count("USER"), 0u);

  ExecUser alice = resolve_exec_user("alice", kPasswd, kGroup);
  auto c = agent::exec_command(spec, req, "h", alice);
  EXPECT_TRUE(c.named_user);
  EXPECT_EQ(c.uid, 1001u);
  EXPECT_EQ(c.gid, 1001u);
  EXPECT_EQ(c.groups, (std::vector<std::uint32_t>{1001, 50, 60}));
  EXPECT_EQ(c.env.at("HOME"), "/home/alice");
  EXPECT_EQ(c.env.at("USER"), "alice");
  EXPECT_EQ(c.env.at("LOGNAME"), "alice");

  spec.env["HOME"] = "/spec-home";
  req.env["USER"] = "req-user";
  auto d = agent::exec_command(spec, req, "h", alice);
  EXPECT_EQ(d.env.at("HOME"), "/spec-home");
  EXPECT_EQ(d.env.at("USER"), "req-user");
  EXPECT_EQ(d.env.at("LOGNAME"), "alice");

  auto n = agent::exec_command(SandboxSpec{}, req, "h", resolve_exec_user("1000:1000", kPasswd, kGroup));
  EXPECT_EQ(n.env.at("HOME"), "/");
  EXPECT_EQ(n.env.count("LOGNAME"), 0u);
}

// ---------------------------------------------------------------------------------------------------- JSON

Error decode_error(const json& j, bool spec) {
  return error_of([&] {
    if (spec) protocol::decode_spec(j);
    else protocol::decode_exec_request(j);
  });
}

TEST(ExecUserProtocol, UserFieldsAreDecodedAndValidatedByName) {
  ExecRequest r = protocol::decode_exec_request(json{{"argv", {"id"}}, {"user", "alice"}});
  EXPECT_EQ(r.user, "alice");
  EXPECT_EQ(protocol::decode_exec_request(json{{"argv", {"id"}}}).user, "");
  EXPECT_EQ(protocol::decode_exec_request(protocol::encode(r)).user, "alice");
  ExecRequest plain;
  plain.argv = {"id"};
  EXPECT_FALSE(protocol::encode(plain).contains("user"));

  for (const json& bad : {json("a b"), json("1:"), json("70000"), json(5), json::array()}) {
    Error e = decode_error(json{{"argv", {"id"}}, {"user", bad}}, false);
    EXPECT_EQ(e.code(), Code::kInvalidArgument) << bad;
    EXPECT_EQ(std::string(e.what()).rfind("user: ", 0), 0u) << e.what();
  }
  SandboxSpec s = protocol::decode_spec(json{{"user", "1000:1000"}});
  EXPECT_EQ(s.user, "1000:1000");
  Error e = decode_error(json{{"user", "1:2:3"}}, true);
  EXPECT_EQ(e.code(), Code::kInvalidArgument);
  EXPECT_EQ(std::string(e.what()).rfind("user: ", 0), 0u) << e.what();
}

TEST(ExecUserProtocol, ProtectedPathsAreValidatedByName) {
  SandboxSpec s = protocol::decode_spec(json{{"protected_paths", {"/grader", "/srv/answers", "/a b"}}});
  EXPECT_EQ(s.protected_paths, (std::vector<std::string>{"/grader", "/srv/answers", "/a b"}));
  SandboxSpec back = protocol::decode_spec(protocol::encode(s));
  EXPECT_EQ(back.protected_paths, s.protected_paths);

  struct Case {
    json paths;
    const char* fragment;
  };
  std::vector<json> too_many;
  for (int i = 0; i < 33; ++i) too_many.push_back("/p" + std::to_string(i));
  for (const Case& c : std::vector<Case>{
           {json{"grader"}, "protected_paths[0]: 'grader' is not an absolute path"},
           {json{"/ok", ""}, "protected_paths[1]"},
           {json{"/"}, "'/' itself"},
           {json{"/a/../etc"}, "'..'"},
           {json{"/.."}, "'..'"},
           {json{"/a//b"}, "not normalized (write '/a/b')"},
           {json{"/a/"}, "not normalized (write '/a')"},
           {json{"/a/./b"}, "not normalized (write '/a/b')"},
           {json{"//"}, "not normalized (write '/')"},
           {json{"/proc"}, "under /proc"},
           {json{"/proc/1/root"}, "under /proc"},
           {json{"/sys/kernel"}, "under /sys"},
           {json{"/dev/shm"}, "under /dev"},
           {json{std::string("/a\0b", 4)}, "without NUL"},
           {json{"/a\nb"}, "newline"},
           {json{std::string(4097, '/')}, "at most 4096"},
           {json(too_many), "33 paths given, at most 32"},
           {json{1}, "protected_paths[0]: must be a string"},
           {json("/grader"), "protected_paths: must be an array"},
       }) {
    Error e = decode_error(json{{"protected_paths", c.paths}}, true);
    EXPECT_EQ(e.code(), Code::kInvalidArgument) << c.paths.dump();
    EXPECT_NE(std::string(e.what()).find(c.fragment), std::string::npos) << c.fragment << " not in: " << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("protected_paths", 0), 0u) << e.what();
  }
  // Names that merely start like the runtime's directories are fine.
  EXPECT_NO_THROW(protocol::decode_spec(json{{"protected_paths", {"/devices", "/process", "/system"}}}));
}

TEST(ExecUserProtocol, ASpecWithoutThemEncodesAsBefore) {
  // So the fingerprint of a spec (request ids) is what it was before these fields existed.
  json j = protocol::encode(SandboxSpec{});
  EXPECT_FALSE(j.contains("user"));
  EXPECT_FALSE(j.contains("protected_paths"));
  SandboxSpec s;
  s.user = "nobody";
  s.protected_paths = {"/grader"};
  json k = protocol::encode(s);
  EXPECT_EQ(k.at("user"), "nobody");
  EXPECT_EQ(k.at("protected_paths"), json({"/grader"}));
  SandboxSpec back = protocol::decode_spec(k);
  EXPECT_EQ(back.user, "nobody");
}

// ---------------------------------------------------------------------------------------------------- wires

std::string u32(std::uint32_t v) {
  std::string s(4, '\0');
  std::memcpy(s.data(), &v, 4);
  return s;
}
std::string str(const std::string& s) { return u32(static_cast<std::uint32_t>(s.size())) + s; }

TEST(ExecUserWire, StartPayloadCarriesTheUserPartOnlyWhenGiven) {
  const std::string base = u32(1) + str("/bin/id") + u32(0) + str("/");
  init_protocol::StartPayload p;
  ASSERT_TRUE(init_protocol::decode_start_payload(base, p));
  EXPECT_FALSE(p.has_user);

  init_protocol::StartPayload q;
  ASSERT_TRUE(init_protocol::decode_start_payload(base + u32(1000) + u32(1001) + u32(2) + u32(1001) + u32(50), q));
  EXPECT_TRUE(q.has_user);
  EXPECT_EQ(q.uid, 1000u);
  EXPECT_EQ(q.gid, 1001u);
  EXPECT_EQ(q.groups, (std::vector<std::uint32_t>{1001, 50}));

  init_protocol::StartPayload r;
  EXPECT_TRUE(init_protocol::decode_start_payload(base + u32(0) + u32(0) + u32(0), r));
  EXPECT_TRUE(r.has_user);
  EXPECT_TRUE(r.groups.empty());

  for (const std::string& bad : {
           base + u32(1000),                                      // cut
           base + u32(1000) + u32(1000),                          // no count
           base + u32(1000) + u32(1000) + u32(1),                 // a group short
           base + u32(1000) + u32(1000) + u32(1) + u32(5) + "x",  // trailing
           base + u32(1000) + u32(1000) + u32(0xffffffffu),       // a count the payload cannot hold
           base + u32(65536) + u32(0) + u32(0),                   // uid out of range
           base + u32(0xffffffffu) + u32(0) + u32(0),             // -1 would mean "unchanged" to setresuid
           base + u32(0) + u32(65536) + u32(0),                   // gid out of range
           base + u32(0) + u32(0) + u32(1) + u32(70000),          // group out of range
       }) {
    init_protocol::StartPayload x;
    EXPECT_FALSE(init_protocol::decode_start_payload(bad, x)) << bad.size();
  }
  std::string many = base + u32(1) + u32(1) + u32(init_protocol::kMaxGroups + 1);
  for (std::uint32_t i = 0; i <= init_protocol::kMaxGroups; ++i) many += u32(i);
  init_protocol::StartPayload m;
  EXPECT_FALSE(init_protocol::decode_start_payload(many, m));
}

TEST(ExecUserWire, GuestExecStartRoundTripsTheUserPart) {
  namespace gp = guest_protocol;
  gp::ExecStart m{{"id"}, {"A=1"}, "/", 100, true, true, 1000, 1000, {1000, 50}};
  std::string p = gp::encode(m);
  gp::ExecStart back = gp::decode_exec_start(p);
  EXPECT_TRUE(back.has_user);
  EXPECT_EQ(back.uid, 1000u);
  EXPECT_EQ(back.gid, 1000u);
  EXPECT_EQ(back.groups, (std::vector<std::uint32_t>{1000, 50}));
  EXPECT_TRUE(back.stdin_follows);
  // Without the user part it is the frame it always was.
  gp::ExecStart root{{"id"}, {"A=1"}, "/", 100, true};
  EXPECT_FALSE(gp::decode_exec_start(gp::encode(root)).has_user);
  EXPECT_EQ(gp::encode(root), p.substr(0, gp::encode(root).size()));
  // Cut inside the user part, a trailing byte, ids out of range.
  for (std::size_t n = gp::encode(root).size() + 1; n < p.size(); ++n)
    EXPECT_THROW(gp::decode_exec_start(p.substr(0, n)), std::out_of_range) << n;
  EXPECT_THROW(gp::decode_exec_start(p + '\0'), std::out_of_range);
  for (auto change : {+[](gp::ExecStart& c) { c.uid = 65536; }, +[](gp::ExecStart& c) { c.gid = 0xffffffffu; },
                      +[](gp::ExecStart& c) { c.groups.push_back(70000); },
                      +[](gp::ExecStart& c) { c.groups.assign(init_protocol::kMaxGroups + 1, 1); }}) {
    gp::ExecStart c = m;
    change(c);
    EXPECT_THROW(gp::decode_exec_start(gp::encode(c)), std::out_of_range);
  }
}

}  // namespace
}  // namespace dsec
