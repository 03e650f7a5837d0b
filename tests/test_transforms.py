import pickle

import numpy as np
import pytest
import torch

from kasoku.data import transforms as T


def test_index_hash_is_a_function_of_seed_epoch_index_salt():
    idx = torch.tensor([0, 1, 2, 7, 123456789, 2**40])
    h = T.index_hash(3, 5, idx, salt=1)
    assert h.dtype == torch.int64 and h.shape == idx.shape
    assert torch.equal(h, T.index_hash(3, 5, idx.tolist(), salt=1))
    # Batch composition does not matter: each element hashes alone to the same bits.
    for i, v in zip(idx.tolist(), h.tolist()):
        assert T.index_hash(3, 5, [i], salt=1).item() == v
        assert T.hash_int(3, 5, i, salt=1) == v & (2**64 - 1)
    for other in (T.index_hash(4, 5, idx, 1), T.index_hash(3, 6, idx, 1),
                  T.index_hash(3, 5, idx, 2)):
        assert (other != h).all()
    assert len(set(h.tolist())) == len(h)


def test_uniform_range_and_spread():
    u = T.uniform(0, 0, torch.arange(20000), salt=9)
    assert u.dtype == torch.float32
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert counts.min() > 1800 and counts.max() < 2200


def test_sample_rng_is_reproducible():
    a = T.sample_rng(1, 2, 3).random()
    assert a == T.sample_rng(1, 2, 3).random()
    assert a != T.sample_rng(1, 3, 3).random()


def test_crop_flip_params_stay_inside_follow_scale_and_depend_on_the_sample_only():
    flips = []
    for i in range(300):
        top, left, h, w, flip = T.crop_flip_params(3, 1, i, 375, 500)
        assert 0 <= top and top + h <= 375 and 0 <= left and left + w <= 500
        assert 0.08 * 0.9 <= h * w / (375 * 500) <= 1.0
        assert T.crop_flip_params(3, 1, i, 375, 500) == (top, left, h, w, flip)
        flips.append(flip)
    assert 100 < sum(flips) < 200
    assert [T.crop_flip_params(3, 2, i, 375, 500) for i in range(20)] != \
        [T.crop_flip_params(3, 1, i, 375, 500) for i in range(20)]


def test_crop_flip_falls_back_to_center_crop():
    # No crop of >= 8% area fits in 10 rows, so every try fails: clamp ratio to 4/3, center.
    top, left, h, w, _ = T.crop_flip_params(0, 0, 0, 10, 1000)
    assert (top, h, w) == (0, 10, 13) and left == (1000 - 13) // 2


def test_batched_crop_flip_params_equal_the_scalar_twin():
    g = torch.Generator().manual_seed(0)
    n = 4000
    heights = torch.randint(10, 1200, (n,), generator=g)
    widths = torch.randint(10, 1200, (n,), generator=g)
    indices = torch.randperm(10 * n, generator=g)[:n]
    boxes, flips = T.crop_flip_params_batch(7, 3, indices, heights, widths)
    for k in range(n):
        want = T.crop_flip_params(7, 3, int(indices[k]), int(heights[k]), int(widths[k]))
        assert (*boxes[k].tolist(), bool(flips[k])) == want, k


def test_center_crop_and_resize_shorter():
    assert T.center_crop_box(256, 341, 224) == (58, 16, 282, 240)
    assert T.resize_shorter_to(375, 500, 256) == (341, 256)
    assert T.resize_shorter_to(500, 375, 256) == (256, 341)


def test_crop_flip_batch_matches_numpy_reflect_padding():
    x = torch.randint(0, 256, (6, 3, 8, 9), dtype=torch.uint8)
    dy = torch.tensor([0, 4, 8, 2, 5, 4])
    dx = torch.tensor([8, 4, 0, 7, 1, 4])
    flip = torch.tensor([False, False, True, True, False, True])
    out = T.crop_flip_batch(x, dy, dx, flip, pad=4)
    assert out.dtype == torch.uint8 and out.shape == x.shape
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (4, 4), (4, 4)), mode="reflect")
    for n in range(6):
        y0, x0 = int(dy[n]), int(dx[n])
        ref = padded[n][:, y0:y0 + 8, x0:x0 + 9]
        if flip[n]:  # crop, then mirror the crop
            ref = ref[:, :, ::-1]
        np.testing.assert_array_equal(out[n].numpy(), ref)
    assert torch.equal(out[1], x[1])  # centred offsets, no flip: identity


def test_random_crop_flip_is_per_sample_deterministic():
    x = torch.randint(0, 256, (10, 3, 16, 16), dtype=torch.uint8)
    idx = torch.arange(10)
    a = T.random_crop_flip(x, seed=0, epoch=1, indices=idx)
    b = T.random_crop_flip(x[[7, 2]], seed=0, epoch=1, indices=idx[[7, 2]])
    assert torch.equal(a[[7, 2]], b)
    c = T.random_crop_flip(x, seed=0, epoch=2, indices=idx)
    assert not torch.equal(a, c)


def test_to_unit_float_normalizes_and_pickles():
    x = torch.randint(0, 256, (4, 3, 5, 5), dtype=torch.uint8)
    f = T.ToUnitFloat(T.CIFAR10_MEAN, T.CIFAR10_STD)
    ref = T.normalize(x.float() / 255, T.CIFAR10_MEAN, T.CIFAR10_STD)
    torch.testing.assert_close(f(x), ref)
    torch.testing.assert_close(pickle.loads(pickle.dumps(f))(x), ref)
    assert torch.equal(T.ToUnitFloat()(x), x.float() / 255)
    with pytest.raises(ValueError):
        T.ToUnitFloat(mean=(0.5,))
