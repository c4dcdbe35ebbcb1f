"""dsec quickstart: one busybox sandbox, a few commands, a file each way.

    dsec image build busybox --from busybox-static     # once, into $DSEC_HOME (default /var/lib/dsec)
    python3 examples/quickstart.py                      # starts a private agent for this script
    python3 examples/quickstart.py unix:/run/dsec/dsecd.sock   # or use a running one
"""

import sys

import dsec


def main() -> int:
    # No endpoints: the client starts its own dsecd and stops it (with its sandboxes) when the block ends.
    with dsec.Client(sys.argv[1:] or None) as client:
        with client.create(image="busybox", cpu=1, memory="256Mi", ttl=600) as sb:  # destroyed on exit
            print("sandbox", sb.id)

            r = sb.exec("echo hello from $(hostname); uname -s")
            print(f"exit {r.exit_code} in {r.duration * 1000:.1f} ms:", r.stdout.decode(), end="")

            r = sb.exec(["wc", "-c"], stdin=b"bytes in, bytes out")  # a list is an argv
            print("wc says", r.stdout.decode().strip())

            sb.write_file("/work/task.txt", b"fix the bug\n")
            r = sb.exec("cat /work/task.txt && echo done > /work/answer.txt")
            print("task:", r.stdout.decode().strip(), "| answer:", sb.read_file("/work/answer.txt").decode().strip())

            r = sb.exec("sleep 10", timeout=0.5)  # a timeout is a result, not an exception
            print("timed out:", r.timed_out)

            try:
                sb.read_file("/no/such/file")
            except dsec.NotFound as e:
                print("as expected:", e.code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
