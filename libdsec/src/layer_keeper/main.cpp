// dsec-layer-keeper: holds the node's layer file system open while its agent is away.
//
// The agent serves its image layers through one FUSE connection (lazy_layer_fs); the kernel aborts a FUSE connection
// when the last descriptor of its /dev/fuse file is closed, and with it every EROFS layer mount and every sandbox
// root stacked on them. The agent therefore starts this program right after mounting, with a duplicate of that
// descriptor as fd 3: while it runs, a killed agent's connection stays, requests wait in the kernel, and the next
// agent takes the descriptor back (pidfd_getfd) and answers them (layer_keeper.hpp).
//
// It holds fd 3 and nothing else: its standard descriptors are /dev/null, every other descriptor is closed, its
// working directory is /, it is in a session of its own (a signal to the agent's process group does not reach it).
// It never reads the connection (requests are the agent's); it only waits for it to end, which poll(2) reports as
// POLLERR once the layer file system is unmounted or aborted, and then exits. SIGTERM (a clean agent shutdown) ends
// it at once.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <initializer_list>

namespace {

constexpr int kFuseFd = 3;

bool is_fuse_device(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 && S_ISCHR(st.st_mode) && major(st.st_rdev) == 10 && minor(st.st_rdev) == 229;
}

}  // namespace

int main() {
  if (!is_fuse_device(kFuseFd)) return 2;
  ::syscall(SYS_close_range, kFuseFd + 1, ~0U, 0);
  (void)!::chdir("/");
  // Terminal and pipe signals mean nothing here; SIGTERM and SIGKILL keep their default action.
  for (int sig : {SIGHUP, SIGINT, SIGQUIT, SIGPIPE, SIGUSR1, SIGUSR2}) ::signal(sig, SIG_IGN);

  pollfd pfd{kFuseFd, 0, 0};  // no events asked for: only POLLERR / POLLHUP / POLLNVAL are reported
  for (;;) {
    int n = ::poll(&pfd, 1, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      return 1;
    }
    if (pfd.revents & (POLLERR | POLLHUP | POLLNVAL)) return 0;
  }
}
