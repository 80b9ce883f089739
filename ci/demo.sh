#!/usr/bin/env bash
# The main job: builds and installs spyreccl (core + torch backend) into a fresh nox virtualenv
# and trains a tensor-parallel transformer block on 2 ranks with torchrun over spyreccl.
#   bash ci/demo.sh                 run the demo
#   bash ci/demo.sh -- --steps 5    arguments after `--` go to the demo script
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
exec "$NOX" --non-interactive --no-color -f "$ROOT/noxfile.py" -s demo "$@"
