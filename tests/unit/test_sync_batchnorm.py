"""The SyncBatchNorm conversion the app uses for ``--trainer.sync_batchnorm true`` (``app.sync_batchnorm``): which layer
each accelerator gets, that conversion keeps the model's tensors, that checkpoints load both ways, that eval mode and a
single process are plain BatchNorm. The numerics on real gloo groups: ``tests/distributed/test_sync_batchnorm.py``."""

from __future__ import annotations

import torch
from torch import nn

from app.sync_batchnorm import CPUSyncBatchNorm, SyncBatchNormPlugin, with_sync_batchnorm
from modules.zoo.mnist_fast import mnist_fast


def _trained_bn() -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(3)
    bn(torch.randn(6, 3, 4, 4) * 2 + 1)  # running statistics away from their initial values
    with torch.no_grad():
        bn.weight.mul_(1.5), bn.bias.add_(0.3)
    return bn


def test_converts_every_batchnorm_keeping_its_tensors_and_reverts_to_the_original_class():
    net = mnist_fast()
    net.eval()
    tensors = dict(net.state_dict(keep_vars=True))
    converted = CPUSyncBatchNorm.convert(net)
    layers = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(layers) == 3 and all(type(m) is CPUSyncBatchNorm and not m.training for m in layers)
    after = converted.state_dict(keep_vars=True)
    assert list(after) == list(tensors) and all(after[k] is tensors[k] for k in tensors)  # same objects, devices
    reverted = CPUSyncBatchNorm.revert(converted)
    assert [type(m) for m in reverted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] == [
        nn.BatchNorm2d
    ] * 3
    assert all(reverted.state_dict(keep_vars=True)[k] is tensors[k] for k in tensors)


def test_checkpoints_load_both_ways_with_batchnorm_and_torch_syncbatchnorm():
    bn = _trained_bn()
    sync = CPUSyncBatchNorm(3)
    sync.load_state_dict(bn.state_dict())  # strict: the same keys
    back = nn.BatchNorm2d(3)
    back.load_state_dict(sync.state_dict())
    torch_sync = nn.SyncBatchNorm(3)
    torch_sync.load_state_dict(sync.state_dict())
    for key, value in bn.state_dict().items():
        assert torch.equal(back.state_dict()[key], value) and torch.equal(torch_sync.state_dict()[key], value), key


def test_eval_mode_normalises_with_the_running_statistics():
    bn = _trained_bn().eval()
    sync = CPUSyncBatchNorm.convert(bn)
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(sync(x), bn(x), atol=0, rtol=0)


def test_without_a_process_group_it_is_batchnorm():
    """One process (single device, or a Trainer without peers): plain BatchNorm, running statistics included."""
    bn, x = _trained_bn(), torch.randn(5, 3, 4, 4)
    sync = CPUSyncBatchNorm.convert(_trained_bn_copy(bn))
    torch.testing.assert_close(sync(x), bn(x), atol=0, rtol=0)
    torch.testing.assert_close(sync.running_var, bn.running_var, atol=0, rtol=0)


def _trained_bn_copy(bn: nn.BatchNorm2d) -> nn.BatchNorm2d:
    copy = nn.BatchNorm2d(3)
    copy.load_state_dict(bn.state_dict())
    return copy


def test_the_plugin_picks_the_cpu_layer_on_cpu_and_torchs_elsewhere():
    on_cpu = SyncBatchNormPlugin().apply(nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3)))
    assert type(on_cpu[1]) is CPUSyncBatchNorm
    # a module that is not on the CPU (meta here: no GPU needed) gets torch's SyncBatchNorm, as Lightning gives it
    elsewhere = SyncBatchNormPlugin().apply(nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3)).to("meta"))
    assert type(elsewhere[1]) is nn.SyncBatchNorm
    for model in (on_cpu, elsewhere):  # and fit's end turns both back into BatchNorm
        assert not any(isinstance(m, (CPUSyncBatchNorm, nn.SyncBatchNorm)) for m in SyncBatchNormPlugin().revert(model))


def test_the_trainer_takes_the_plugin_with_sync_batchnorm_true():
    from lightning.pytorch import Trainer

    from app.checkpoint import AtomicCheckpointIO

    plugins = with_sync_batchnorm(AtomicCheckpointIO())  # the config's plugins are kept
    assert isinstance(plugins[0], AtomicCheckpointIO)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", sync_batchnorm=True, plugins=plugins)
    assert isinstance(trainer.strategy._layer_sync, SyncBatchNormPlugin)
