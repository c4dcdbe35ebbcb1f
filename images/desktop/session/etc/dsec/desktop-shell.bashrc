# The shell of the desktop's terminal (openbox's autostart): root's own rc, then the desktop's ready marker once the
# first prompt is drawn, when keys typed into the terminal reach this shell.
if [ -f /root/.bashrc ]; then . /root/.bashrc; fi
PROMPT_COMMAND='touch /run/dsec-desktop-ready; unset PROMPT_COMMAND'
