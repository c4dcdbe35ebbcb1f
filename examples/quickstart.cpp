// dsec quickstart from C++: one busybox sandbox, a few commands, a file each way.
//
//   dsec image build busybox --from busybox-static     # once, into $DSEC_HOME (default /var/lib/dsec)
//   ./build/bin/quickstart                              # starts a private agent for this program
//   ./build/bin/quickstart unix:/run/dsec/dsecd.sock    # or use a running one
#include <dsec/dsec.hpp>

#include <iostream>

int main(int argc, char** argv) try {
  dsec::ClientOptions options;
  for (int i = 1; i < argc; ++i) options.endpoints.push_back(argv[i]);
  dsec::Client client(options);  // no endpoints: a private dsecd, stopped with the client

  dsec::SandboxSpec spec;
  spec.image = "busybox";
  spec.resources.memory_bytes = *dsec::parse_size("256Mi");
  spec.ttl = std::chrono::minutes(10);
  dsec::Sandbox sb = client.create(spec);  // owning: destroyed when it goes out of scope
  std::cout << "sandbox " << sb.id() << "\n";

  dsec::ExecResult r = sb.exec("echo hello from $(hostname)");
  std::cout << "exit " << r.exit_code << ": " << r.stdout_data;

  dsec::ExecRequest wc;
  wc.argv = {"wc", "-c"};
  wc.stdin_data = "bytes in, bytes out";
  std::cout << "wc says " << sb.exec(wc).stdout_data;

  sb.write_file("/work/task.txt", "fix the bug\n");
  sb.exec("cat /work/task.txt > /dev/null && echo done > /work/answer.txt");
  std::cout << "answer: " << sb.read_file("/work/answer.txt");

  dsec::ExecResult slow = sb.exec("sleep 10", /*timeout_seconds=*/0.5);  // a timeout is a result
  std::cout << "timed out: " << std::boolalpha << slow.timed_out << "\n";

  sb.destroy();
  return 0;
} catch (const dsec::Error& e) {
  std::cerr << "dsec: " << e.code_name() << ": " << e.what() << "\n";
  return 1;
}
