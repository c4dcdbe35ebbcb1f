#!/usr/bin/env python3
"""A computer-use episode on dsec's desktop image: a full VM (kind "vm") with a screen, driven by keyboard and
pointer the way a computer-use agent drives a desktop, and scored by reading what it saved through the files API.

The episode opens the text editor from the desktop's terminal, types a note, saves it with ctrl+s, and closes the
editor; a screenshot after each step is saved as a PNG. The reward is 1.0 when the saved file holds exactly the
note. A scripted policy stands in for the model here: a trainer would send each screenshot to its policy and turn
the policy's answer into the same calls (sb.click, sb.key, sb.type_text, ...).

    sudo scripts/desktop-image.sh                  # once: the desktop image (about 6 minutes)
    sudo PYTHONPATH=build/python /usr/bin/python3 examples/computer_use.py --out /tmp/episode
    sudo PYTHONPATH=build/python /usr/bin/python3 examples/computer_use.py --endpoint unix:/run/dsec/dsecd.sock

Without KVM the VM runs under TCG: the first create boots the desktop (about a minute on a small machine) and
freezes it as a template; later creates on the same agent start from it in seconds.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import time
import zlib

import dsec

NOTE = "Hello from a dsec computer-use episode.\nSaved with ctrl+s.\n"
PATH = "/root/note.txt"


def rgb_rows(png: bytes) -> list[bytes]:
    """The pixel rows of an 8-bit RGB PNG (what a full VM's screenshot is): enough of a PNG reader to look at the
    screen without a library."""
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", png[16:29])
    if (depth, color, interlace) != (8, 2, 0):
        raise ValueError(f"not an 8-bit RGB PNG (depth {depth}, color type {color}, interlace {interlace})")
    data, at = b"", 8
    while at < len(png):
        length, kind = struct.unpack(">I4s", png[at:at + 8])
        if kind == b"IDAT":
            data += png[at + 8:at + 8 + length]
        at += 12 + length
    raw, stride, rows, prev = zlib.decompress(data), width * 3, [], bytes(width * 3)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - 3] if i >= 3 else 0
            b, c = prev[i], prev[i - 3] if i >= 3 else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = rows[-1]
    return rows


def white_area(png: bytes) -> int:
    """Pixels of the screen that are (near) white, sampled every 4th pixel of every 4th row: a window of a text
    editor or a terminal is mostly white on this desktop's black background."""
    count = 0
    for row in rgb_rows(png)[::4]:
        for x in range(0, len(row), 12):
            if row[x] > 240 and row[x + 1] > 240 and row[x + 2] > 240:
                count += 16
    return count


def wait_for_window(sb: dsec.Sandbox, before: bytes, grows: bool, timeout: float = 120.0) -> bytes:
    """Waits until a window of at least 300x300 white pixels has appeared on the screen (grows) or gone from it;
    the screen then, once it has been still for a second."""
    base, deadline = white_area(before), time.monotonic() + timeout
    while time.monotonic() < deadline:
        shot = sb.screenshot()
        if (white_area(shot) - base if grows else base - white_area(shot)) > 90_000:
            return settled(sb, before)
        time.sleep(0.5)
    raise TimeoutError(f"no window {'appeared' if grows else 'went'} within {timeout:.0f} s")


def settled(sb: dsec.Sandbox, before: bytes, timeout: float = 60.0, quiet: float = 1.0) -> bytes:
    """Waits until the screen has changed from `before` and then stayed the same for `quiet` seconds (the guest has
    drawn what the last action caused); the screen then. A policy would look at it now."""
    deadline = time.monotonic() + timeout
    last, changed, still_since = before, False, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        shot = sb.screenshot()
        if shot != last:
            changed, last, still_since = changed or shot != before, shot, time.monotonic()
        elif changed and time.monotonic() - still_since >= quiet:
            return shot
    if not changed:
        raise TimeoutError(f"the screen did not change within {timeout:.0f} s")
    return last


class Episode:
    def __init__(self, sb: dsec.Sandbox, out_dir: str) -> None:
        self.sb = sb
        self.out_dir = out_dir
        self.steps = 0
        self.screen = sb.screenshot()
        self.save("start", self.screen)

    def save(self, name: str, png: bytes) -> None:
        path = os.path.join(self.out_dir, f"{self.steps:02d}-{name}.png")
        with open(path, "wb") as f:
            f.write(png)
        print(f"step {self.steps}: {name:<14} {len(png):>7} bytes -> {path}", flush=True)
        self.steps += 1

    def act(self, name: str, action, *, settle: bool = True, window: bool | None = None) -> None:
        """One step: the action, then the screen once the guest has drawn its effect (with `window`, once a window
        has appeared (True) or gone (False))."""
        action()
        if window is not None:
            self.screen = wait_for_window(self.sb, self.screen, grows=window)
        else:
            self.screen = settled(self.sb, self.screen) if settle else self.sb.screenshot()
        self.save(name, self.screen)


def run_episode(sb: dsec.Sandbox, out_dir: str) -> float:
    ep = Episode(sb, out_dir)
    width, height = sb.screen()["width"], sb.screen()["height"]
    # The editor is opened from the desktop's terminal (its window is at the top left), by keyboard.
    ep.act("focus-terminal", lambda: sb.click(300, 250), settle=False)
    # The editor's window is a large white area that was not there: the policy waits until it sees it.
    ep.act("open-editor", lambda: sb.type_text(f"mousepad {PATH} &\n"), window=True)
    # The editor's window has the focus; its document is empty.
    ep.act("type-note", lambda: sb.type_text(NOTE))
    ep.act("save", lambda: sb.key("ctrl+s"))
    ep.act("close-editor", lambda: sb.key("ctrl+q"), window=False)
    # A last look with the pointer parked in the screen's corner.
    ep.act("done", lambda: sb.mouse_move(width - 1, height - 1), settle=False)
    try:
        saved = sb.read_file(PATH).decode(errors="replace")
    except dsec.NotFound:
        saved = None
    print(f"saved file: {saved!r}")
    return 1.0 if saved == NOTE else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", help="an agent to use (default: an embedded one)")
    parser.add_argument("--image", default="desktop", help="the desktop image (scripts/desktop-image.sh)")
    parser.add_argument("--display", default="1024x768", help="the screen's size")
    parser.add_argument("--memory", default="1Gi")
    parser.add_argument("--out", default="computer-use-episode", help="where the screenshots go")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    client = dsec.Client(endpoints=[args.endpoint]) if args.endpoint else dsec.Client()
    with client:
        t0 = time.monotonic()
        with client.create(args.image, "vm", cpu=2, memory=args.memory, display=args.display, ttl=1800) as sb:
            accel = client.nodes()[0].vm.accelerator
            print(f"full VM {sb.id} ready in {time.monotonic() - t0:.1f} s ({accel}); screen {sb.screen()}")
            t1 = time.monotonic()
            score = run_episode(sb, args.out)
            print(f"episode: {time.monotonic() - t1:.1f} s")
    print(f"score {score}")
    return 0 if score == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
