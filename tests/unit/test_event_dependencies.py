"""snnfw's event paths work with tonic installed as scripts/install.sh installs it: without librosa, which tonic
declares for its audio transforms only and which brings numba, llvmlite and scikit-learn."""

import subprocess
import sys

LEFT_OUT = ("librosa", "numba", "llvmlite", "sklearn")

# In a fresh interpreter, with the packages left out made unimportable: every event format is read from its raw
# files and framed (Denoise included), and a sample is integrated again after each event augment.
SCRIPT = f"""
import sys
for name in {LEFT_OUT!r}:
    sys.modules[name] = None  # `import name` raises ImportError, as where it is not installed
from pathlib import Path

from snnfw.config import build_config
from snnfw.data.augment import Augmented, augment_options
from snnfw.data.batches import InputSpec
from snnfw.testing import raw_events
from snnfw_plugins.datasets import events, neuromorphic

writers = {{"n_mnist": raw_events.write_nmnist, "cifar10_dvs": raw_events.write_cifar10_dvs,
           "dvs128_gesture": raw_events.write_dvs128_gesture, "shd": raw_events.write_shd,
           "n_caltech101": raw_events.write_ncaltech101, "asl_dvs": raw_events.write_asl_dvs,
           "dvs_lip": raw_events.write_dvs_lip}}
for name, write in writers.items():
    write(Path(name), per_class=2)
    frames = {{"by": "time"}} if name == "shd" else {{"by": "time", "denoise_us": 20000}}
    data = build_config({{"data": {{"name": name, "root": name, "frames": frames}}}}).data
    counts, labels = events.cached_frames(data, name, "train", 4)
    assert counts.shape[0] == len(labels) > 0 and counts[0].sum() > 0, name
augments = ["drop_event", "time_jitter", "spatial_jitter"]
data = build_config({{"data": {{"name": "n_mnist", "root": "n_mnist", "augment": augments}}}}).data
train = neuromorphic.builder("n_mnist")(data, InputSpec(time_steps=4, shape=(2, 34, 34), num_classes=10), "train", 0)
frames, label = Augmented(train, data.augment, augment_options(data), seed=0)[0]
assert frames.shape == (4, 2, 34, 34) and frames.sum() > 0
print("framed without", *sorted(name for name in {LEFT_OUT!r} if sys.modules.get(name, 0) is None))
"""


def test_event_data_sets_read_frame_and_augment_without_librosa_numba_llvmlite_or_scikit_learn(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["framed", "without", *sorted(LEFT_OUT)]
