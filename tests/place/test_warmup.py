"""The first transfer's warm-up: started for accelerators only, and harmless when it runs."""

import jax

from otfload.place import warmup


def test_cpu_devices_start_nothing():
    assert warmup.start_first_transfers(jax.devices()) is None


def test_the_transfer_itself_copies_one_byte_to_each_device(monkeypatch):
    """Run on CPU devices (as if they were accelerators): each device gets its byte, the thread ends."""
    seen = []
    real_put = jax.device_put

    def counting_put(x, device):
        seen.append(device)
        return real_put(x, device)

    monkeypatch.setattr(warmup.jax, "device_put", counting_put)
    devices = jax.devices()
    warmup._transfer_once(devices)
    assert seen == devices


def test_a_failing_device_is_left_for_the_load_to_report(monkeypatch):
    def broken(x, device):
        raise RuntimeError("device lost")

    monkeypatch.setattr(warmup.jax, "device_put", broken)
    warmup._transfer_once(jax.devices())  # no raise here: the load meets the same error and raises it
