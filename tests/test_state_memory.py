"""Peak memory of streaming: ~1 GiB of 64 MiB tensors through an identity mapper in a fresh process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file

from d9d.state import INDEX_NAME

MIB = 1024 * 1024
FILES, PER_FILE, TENSOR_MIB = 4, 4, 64  # 16 x 64 MiB = 1 GiB

_CHILD = textwrap.dedent(
    """
    import json, sys
    import psutil, torch
    from d9d.state import Identity, read_model_state

    def peak_rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    path, keys = sys.argv[1], json.loads(sys.argv[2])
    mapper = Identity(keys)
    # Reset the kernel's peak-RSS mark so the import-time peak of torch does not count.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = psutil.Process().memory_info().rss
    seen = {}
    for key, tensor in read_model_state(path, mapper):
        lo, hi = torch.aminmax(tensor)  # touches every byte, as copying into a parameter would
        seen[key] = (float(lo), float(hi), tensor.numel())
        del tensor
    print(json.dumps({"base": base, "peak": peak_rss(), "seen": seen}))
    """
)


def test_streaming_one_gib_keeps_peak_rss_rise_under_300_mib():
    root = Path(tempfile.mkdtemp(prefix="d9d-state-mem-"))
    try:
        numel = TENSOR_MIB * MIB // 4
        weight_map: dict[str, str] = {}
        for f in range(FILES):
            name = f"model-{f + 1:05d}-of-{FILES:05d}.safetensors"
            part = {
                f"t{f * PER_FILE + i}": torch.full((numel,), float(f * PER_FILE + i)) for i in range(PER_FILE)
            }
            save_file(part, str(root / name))
            weight_map.update(dict.fromkeys(part, name))
            del part
        (root / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))

        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(root), json.dumps(sorted(weight_map))],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        report = json.loads(out.stdout.strip().splitlines()[-1])
        # Every tensor arrived intact (all its elements equal its index).
        assert report["seen"] == {k: [float(k[1:]), float(k[1:]), numel] for k in weight_map}
        rise_mib = (report["peak"] - report["base"]) / MIB
        assert rise_mib < 300, f"peak RSS rose by {rise_mib:.0f} MiB streaming 1 GiB"
    finally:
        shutil.rmtree(root, ignore_errors=True)
