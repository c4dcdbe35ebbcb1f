#include "common/wire/guest_protocol.hpp"

#include <cctype>
#include <cstring>
#include <stdexcept>

#include "common/wire/init_protocol.hpp"

namespace dsec::guest_protocol {
namespace {

void put_u32(std::string& out, std::uint32_t v) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out.append(b, 4);
}

std::uint32_t get_u32(const char* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

}  // namespace

void append_frame(std::string& out, Type type, std::uint32_t channel, std::string_view payload) {
  put_u32(out, static_cast<std::uint32_t>(payload.size() + 5));
  out.push_back(static_cast<char>(type));
  put_u32(out, channel);
  out.append(payload);
}

std::optional<Frame> FrameReader::next() {
  if (buffered() < 4) return std::nullopt;
  std::uint32_t size = get_u32(buffer_.data() + pos_);
  if (size < 5 || size > kMaxFrameBytes) throw std::length_error("guest protocol: frame size " + std::to_string(size));
  if (buffered() < 4 + static_cast<std::size_t>(size)) return std::nullopt;
  Frame f;
  const char* p = buffer_.data() + pos_ + 4;
  f.type = static_cast<Type>(static_cast<unsigned char>(p[0]));
  f.channel = get_u32(p + 1);
  f.payload.assign(p + 5, size - 5);
  pos_ += 4 + size;
  // Compact once the consumed part dominates, so the buffer does not grow without end.
  if (pos_ == buffer_.size()) {
    buffer_.clear();
    pos_ = 0;
  } else if (pos_ > (1u << 20) && pos_ * 2 > buffer_.size()) {
    buffer_.erase(0, pos_);
    pos_ = 0;
  }
  return f;
}

Writer& Writer::u8(std::uint8_t v) {
  out_.push_back(static_cast<char>(v));
  return *this;
}
Writer& Writer::u32(std::uint32_t v) {
  put_u32(out_, v);
  return *this;
}
Writer& Writer::u64(std::uint64_t v) {
  put_u32(out_, static_cast<std::uint32_t>(v & 0xffffffffu));
  put_u32(out_, static_cast<std::uint32_t>(v >> 32));
  return *this;
}
Writer& Writer::str(std::string_view s) {
  put_u32(out_, static_cast<std::uint32_t>(s.size()));
  out_.append(s);
  return *this;
}
Writer& Writer::strs(const std::vector<std::string>& v) {
  put_u32(out_, static_cast<std::uint32_t>(v.size()));
  for (const auto& s : v) str(s);
  return *this;
}

std::uint8_t Reader::u8() {
  if (in_.size() - pos_ < 1) throw std::out_of_range("guest protocol: short payload");
  return static_cast<std::uint8_t>(in_[pos_++]);
}
std::uint32_t Reader::u32() {
  if (in_.size() - pos_ < 4) throw std::out_of_range("guest protocol: short payload");
  std::uint32_t v = get_u32(in_.data() + pos_);
  pos_ += 4;
  return v;
}
std::uint64_t Reader::u64() {
  std::uint64_t lo = u32();
  std::uint64_t hi = u32();
  return lo | (hi << 32);
}
std::string Reader::str() {
  std::uint32_t n = u32();
  if (in_.size() - pos_ < n) throw std::out_of_range("guest protocol: short string");
  std::string s(in_.substr(pos_, n));
  pos_ += n;
  return s;
}
std::vector<std::string> Reader::strs(std::uint32_t max_count) {
  std::uint32_t n = u32();
  // Every string costs at least its 4-byte length: a count the payload cannot hold is malformed.
  if (n > max_count || n > (in_.size() - pos_) / 4) throw std::out_of_range("guest protocol: bad string count");
  std::vector<std::string> out;
  out.reserve(n);
  for (std::uint32_t i = 0; i < n; ++i) out.push_back(str());
  return out;
}
void Reader::finish() const {
  if (!done()) throw std::out_of_range("guest protocol: trailing bytes");
}

std::string encode(const ExecStart& m) {
  Writer w;
  w.strs(m.argv).strs(m.env).str(m.cwd).u64(m.max_output).u8(m.stdin_follows ? 1 : 0);
  if (m.has_user) {
    w.u32(m.uid).u32(m.gid).u32(static_cast<std::uint32_t>(m.groups.size()));
    for (std::uint32_t g : m.groups) w.u32(g);
  }
  return w.take();
}
ExecStart decode_exec_start(std::string_view payload) {
  Reader r(payload);
  ExecStart m;
  m.argv = r.strs();
  m.env = r.strs();
  m.cwd = r.str();
  m.max_output = r.u64();
  m.stdin_follows = r.u8() != 0;
  m.has_user = !r.done();
  if (m.has_user) {
    m.uid = r.u32();
    m.gid = r.u32();
    std::uint32_t n = r.u32();
    if (m.uid > init_protocol::kMaxId || m.gid > init_protocol::kMaxId || n > init_protocol::kMaxGroups)
      throw std::out_of_range("guest protocol: exec user out of range");
    for (std::uint32_t i = 0; i < n; ++i) {
      m.groups.push_back(r.u32());
      if (m.groups.back() > init_protocol::kMaxId) throw std::out_of_range("guest protocol: exec group out of range");
    }
  }
  r.finish();
  if (m.argv.empty()) throw std::out_of_range("guest protocol: exec without argv");
  for (const auto* list : {&m.argv, &m.env})
    for (const auto& s : *list)
      if (s.find('\0') != std::string::npos) throw std::out_of_range("guest protocol: NUL in argv or env");
  if (m.cwd.find('\0') != std::string::npos) throw std::out_of_range("guest protocol: NUL in cwd");
  return m;
}

std::string encode(const Hello& m) {
  Writer w;
  w.u64(m.realtime_ns).str(m.entropy).str(m.hostname);
  return w.take();
}
Hello decode_hello(std::string_view payload) {
  Reader r(payload);
  Hello m;
  m.realtime_ns = r.u64();
  m.entropy = r.str();
  m.hostname = r.str();
  r.finish();
  return m;
}

std::string encode(const HelloReply& m) {
  Writer w;
  w.str(m.kernel_release).u8(m.root_ready ? 1 : 0).u32(m.execs_running);
  return w.take();
}
HelloReply decode_hello_reply(std::string_view payload) {
  Reader r(payload);
  HelloReply m;
  m.kernel_release = r.str();
  m.root_ready = r.u8() != 0;
  m.execs_running = r.u32();
  r.finish();
  return m;
}

std::string encode(const Setup& m) {
  Writer w;
  w.u32(static_cast<std::uint32_t>(m.layers.size()));
  for (const auto& l : m.layers) w.str(l.serial).str(l.data_serial);
  w.str(m.disk_serial);
  return w.take();
}
Setup decode_setup(std::string_view payload) {
  Reader r(payload);
  Setup m;
  std::uint32_t n = r.u32();
  if (n > 128) throw std::out_of_range("guest protocol: too many layers");
  for (std::uint32_t i = 0; i < n; ++i) {
    SetupLayer l;
    l.serial = r.str();
    l.data_serial = r.str();
    m.layers.push_back(std::move(l));
  }
  m.disk_serial = r.str();
  r.finish();
  return m;
}

namespace {

bool valid_serial(std::string_view s) {
  if (s.empty() || s.size() > 20) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
  return true;
}

std::string_view checked_serial(std::string_view s) {
  if (!valid_serial(s)) throw std::invalid_argument("dsec_root: '" + std::string(s) + "' is not a disk serial");
  return s;
}

}  // namespace

std::string encode_root_word(const Setup& m) {
  std::string word(checked_serial(m.disk_serial));
  word += '/';
  for (std::size_t i = 0; i < m.layers.size(); ++i) {
    if (i) word += ',';
    word += checked_serial(m.layers[i].serial);
    if (!m.layers[i].data_serial.empty()) word += "+" + std::string(checked_serial(m.layers[i].data_serial));
  }
  return word;
}

Setup decode_root_word(std::string_view word) {
  Setup m;
  std::size_t slash = word.find('/');
  if (slash == std::string_view::npos) throw std::invalid_argument("dsec_root: no '/' after the disk's serial");
  m.disk_serial = checked_serial(word.substr(0, slash));
  std::string_view rest = word.substr(slash + 1);
  while (!rest.empty()) {
    std::size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    SetupLayer l;
    std::size_t plus = item.find('+');
    l.serial = checked_serial(item.substr(0, plus));
    if (plus != std::string_view::npos) l.data_serial = checked_serial(item.substr(plus + 1));
    m.layers.push_back(std::move(l));
    if (m.layers.size() > 128) throw std::invalid_argument("dsec_root: more than 128 layers");
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
    if (rest.empty()) throw std::invalid_argument("dsec_root: a ',' with no layer after it");
  }
  return m;
}

std::string encode(const Exited& m) {
  Writer w;
  w.i32(m.status).u8(m.stdout_truncated ? 1 : 0).u8(m.stderr_truncated ? 1 : 0).u8(m.oom_killed ? 1 : 0);
  return w.take();
}
Exited decode_exited(std::string_view payload) {
  Reader r(payload);
  Exited m;
  m.status = r.i32();
  m.stdout_truncated = r.u8() != 0;
  m.stderr_truncated = r.u8() != 0;
  // A VM restored from a template its older init made sends no OOM byte.
  if (!r.done()) m.oom_killed = r.u8() != 0;
  r.finish();
  return m;
}

std::string encode(const files::TreeEntry& m) {
  Writer w;
  w.u8(static_cast<std::uint8_t>(m.kind)).str(m.path).u32(m.mode).str(m.link).u64(m.size).u32(m.uid).u32(m.gid);
  w.u64(static_cast<std::uint64_t>(m.mtime));
  w.u64(static_cast<std::uint64_t>(m.atime_ns)).u64(static_cast<std::uint64_t>(m.mtime_ns)).u8(m.opaque ? 1 : 0);
  return w.take();
}
files::TreeEntry decode_entry(std::string_view payload) {
  Reader r(payload);
  files::TreeEntry m;
  std::uint8_t kind = r.u8();
  if (kind < 1 || kind > 6) throw std::out_of_range("guest protocol: bad entry kind");
  m.kind = static_cast<files::EntryKind>(kind);
  m.path = r.str();
  m.mode = r.u32();
  m.link = r.str();
  m.size = r.u64();
  m.uid = r.u32();
  m.gid = r.u32();
  m.mtime = static_cast<std::int64_t>(r.u64());
  m.atime_ns = static_cast<std::int64_t>(r.u64());
  m.mtime_ns = static_cast<std::int64_t>(r.u64());
  m.opaque = r.u8() != 0;
  r.finish();
  if (m.path.find('\0') != std::string::npos || m.link.find('\0') != std::string::npos)
    throw std::out_of_range("guest protocol: NUL in an entry");
  return m;
}

std::string encode(const ErrorReply& m) {
  Writer w;
  w.u32(m.code).str(m.message);
  return w.take();
}
ErrorReply decode_error(std::string_view payload) {
  Reader r(payload);
  ErrorReply m;
  m.code = r.u32();
  m.message = r.str();
  r.finish();
  return m;
}

}  // namespace dsec::guest_protocol
