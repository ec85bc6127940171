"""The HF reader fills a model on the GPU (each region copied from host to device as it is read): the weights are
those a CPU load gives, bit for bit, FP8 block-scaled ones included."""

import torch

from tests.unit.components.test_hf_checkpoint import single_process_load, write_fp8_release
from tests.unit.distributed._model_parity import tiny_args
from tests.unit.models.deepseek_v3.test_hf import _random_model
from torchtitan.components.hf_checkpoint import HFCheckpoint
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter


def test_a_model_on_the_gpu_gets_the_weights_a_cpu_load_gives(tmp_path):
    args = tiny_args()
    folder = write_fp8_release(tmp_path / "hf", args, _random_model(args).state_dict(), lambda key: "all.safetensors")
    with torch.device("cuda"):
        model = DeepSeekV3Model(args)
    checkpoint = HFCheckpoint(str(folder))
    state = model.state_dict()
    checkpoint.read_into(state, DeepSeekV3StateDictAdapter(args).hf_sources(checkpoint.keys()))
    for name, value in single_process_load(folder, args).items():
        torch.testing.assert_close(model.state_dict()[name].cpu(), value, rtol=0, atol=0, msg=name)
