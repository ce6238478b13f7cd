#!/usr/bin/env bash
# Puts the files of ops/train/gpu_build.sh (a folder holding the shards and meta.tar) into the
# package data folder the embedded default model is served from (or DEST), and checks they are
# complete.
#     bash ops/train/install_default.sh /path/to/files_at [DEST]
set -euo pipefail
src=${1:?folder with the shards and meta.tar}
dest=${2:-$(dirname "$0")/../../appliance/assets/default}
mkdir -p "$dest"
cp "$src"/*.safetensors "$dest"/
tar -C "$dest" -xf "$src/meta.tar"
"${PYTHON:-python3}" -c "
import pathlib, sys
from appliance.assets.default_model import shipped_model_dir
path = shipped_model_dir(pathlib.Path(sys.argv[1]).resolve())
print('default model files complete:', path)
sys.exit(path is None)
" "$dest"
du -ch "$dest"/*.safetensors | tail -1
