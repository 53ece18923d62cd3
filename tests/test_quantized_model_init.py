"""tl.quantized_model_init: layers whose weight Parameter holds only the recipe's quantized form.

The forward reads that quantized weight as it is; a stock AdamW steps high-precision masters kept outside
the model (tl.optim.MasterWeights), from which the weights are requantized after each step. With the
initial weight preserved as the master (preserve_high_precision_init_val=True), every recipe whose weight
scale comes from the weight itself (all but delayed scaling) trains bit for bit as the high-precision-
weight Linear does (the same quantizer on the same master); under delayed scaling the stored weight takes
its scale from its own amax rather than the history, and a master started from the dequantized weight
starts one FP8 rounding away: those agree to a tolerance.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from recipe_tables import NAMES, ONE_WEIGHT_COPY, SEPARATE_WEIGHT_COPY
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import transformer_linear as tl
from transformer_linear import recipe
from transformer_linear.modules import quantized_init
from transformer_linear.modules.quantized_init import QuantizedWeight
from transformer_linear.numerics.model import GPTConfig, SyntheticText, TinyGPT, lm_loss

# Recipes whose columnwise weight usage is the rowwise one transposed: one stored copy; the others' columnwise
# weight copy has blocks of its own (two copies unless rowwise_only).
ONE_COPY, TWO_COPIES = ONE_WEIGHT_COPY, SEPARATE_WEIGHT_COPY


def _mlp(width=64, hidden=128):
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


def _quantized_layers(model):
    return [m for m in model.modules() if isinstance(m, tl.Linear)]


def _train(model, rec, steps, batches, loss_fn, master_weights):
    if master_weights:
        masters = tl.optim.MasterWeights(model)
        opt = torch.optim.AdamW(masters.parameters(), lr=1e-2)
        masters.attach(opt)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches[:steps]:
        with tl.autocast(recipe=rec):
            loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _mlp_loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _bits(t):
    return t.view(torch.uint8)


class TestStorage:
    @pytest.mark.parametrize("name", NAMES)
    def test_parameter_bytes(self, name):
        """The layer's parameters are the quantized weight alone: <= 0.3x fp32 where one copy serves both
        usages; MX / rowwise scaling keep their columnwise copy (its own blocks) too."""
        rec = recipe.from_name(name)
        with tl.quantized_model_init(recipe=rec):
            layer = tl.Linear(256, 256, bias=False)
        assert isinstance(layer.weight, QuantizedWeight) and isinstance(layer.weight, nn.Parameter)
        assert layer.weight.shape == (256, 256) and layer.weight.dtype == torch.float32
        fp32_bytes = 256 * 256 * 4
        ratio = tl.quantized_weight_bytes(layer) / fp32_bytes
        quantizer = recipe.quantization.quantization_spec(rec).weight
        if quantizer.is_nvfp4:
            # Half a byte per element, one E4M3 scale per 16: the rowwise copy of 16x16 tiles alone.
            assert layer.weight.weight_fp8_t is None
            assert ratio == pytest.approx((0.5 + 1 / 16) / 4, abs=1e-3), ratio
        elif name in ONE_COPY:
            assert layer.weight.weight_fp8_t is None
            assert 0.25 <= ratio <= 0.3, ratio
        else:
            assert 0.5 <= ratio <= 0.5 * (1 + 1 / 32) + 1e-3, ratio
        # Nothing else of the weight's size is held by the layer.
        assert [n for n, _ in layer.named_parameters()] == ["weight"]

    @pytest.mark.parametrize("name", TWO_COPIES)
    def test_rowwise_only_stores_one_copy(self, name):
        """rowwise_only: recipes whose columnwise copy has its own blocks store the rowwise copy alone
        (<= 0.3x fp32); the forward's columnwise copy is the stored weight quantized columnwise."""
        rec = recipe.from_name(name)
        with tl.quantized_model_init(recipe=rec, preserve_high_precision_init_val=True, rowwise_only=True):
            layer = tl.Linear(256, 256, bias=False)
        with tl.quantized_model_init(recipe=rec, preserve_high_precision_init_val=True):
            both = tl.Linear(256, 256, bias=False)
        both.weight.quantize_(tl.get_high_precision_init_val(layer))
        assert layer.weight.weight_fp8_t is None and layer.weight.weight_scale_inv_t is None
        ratio = tl.quantized_weight_bytes(layer) / (256 * 256 * 4)
        assert ratio <= 0.3 and ratio == pytest.approx(tl.quantized_weight_bytes(both) / (256 * 256 * 4) / 2, rel=0.01)
        assert torch.equal(_bits(layer.weight.weight_fp8), _bits(both.weight.weight_fp8))  # the same rowwise copy
        quantizer = recipe.quantization.quantization_spec(rec).weight
        expected = quantized_init.quantize_weight(quantizer, layer.weight.dequantize())
        cached = layer.weight.cached_weight
        assert torch.equal(_bits(cached.weight_fp8_t), _bits(expected.weight_fp8_t))
        assert torch.equal(_bits(cached.weight_scale_inv_t), _bits(expected.weight_scale_inv_t))

    @pytest.mark.parametrize("name", ["current", "block", "mxfp8"])
    def test_stored_weight_is_the_quantizers_result(self, name):
        rec = recipe.from_name(name)
        with tl.quantized_model_init(recipe=rec, preserve_high_precision_init_val=True):
            layer = tl.Linear(256, 128)
        init = tl.get_high_precision_init_val(layer)
        q = recipe.quantization.quantization_spec(rec).weight.quantize(init, True, True)
        cached = layer.weight.cached_weight  # what the forward reads: the transposed copy made where derived
        assert torch.equal(_bits(cached.weight_fp8), _bits(q.data))
        if q.data_t.numel():
            assert torch.equal(_bits(cached.weight_fp8_t), _bits(q.data_t))
            assert torch.equal(_bits(cached.weight_scale_inv_t), _bits(q.scale_inv_t))

    def test_outside_and_disabled_keep_high_precision(self):
        assert type(tl.Linear(8, 8).weight) is nn.Parameter
        with tl.quantized_model_init(recipe=recipe.from_name("current")):
            with tl.quantized_model_init(enabled=False):
                assert type(tl.Linear(8, 8).weight) is nn.Parameter
            assert isinstance(tl.Linear(8, 8).weight, QuantizedWeight)
        assert type(tl.Linear(8, 8).weight) is nn.Parameter

    def test_default_recipe_is_delayed_and_alias(self):
        with tl.fp8_model_init():
            layer = tl.Linear(16, 16)
        assert isinstance(layer.quantized_init.recipe, recipe.DelayedScaling)
        assert tl.fp8_model_init is tl.quantized_model_init

    def test_convert_to_fp8_inside(self):
        model = _mlp()
        with tl.quantized_model_init(recipe=recipe.from_name("block")):
            model = tl.convert_to_fp8(model)
        assert all(isinstance(layer.weight, QuantizedWeight) for layer in _quantized_layers(model))

    def test_preserve_high_precision_init_val(self):
        torch.manual_seed(0)
        reference = nn.Linear(16, 16).weight.detach()
        torch.manual_seed(0)
        with tl.quantized_model_init(recipe=recipe.from_name("current"), preserve_high_precision_init_val=True):
            layer = tl.Linear(16, 16)
        init = tl.get_high_precision_init_val(layer)
        assert torch.equal(init, reference)
        tl.clear_high_precision_init_val(layer)
        assert tl.get_high_precision_init_val(layer) is None
        with tl.quantized_model_init(recipe=recipe.from_name("current")):
            assert tl.get_high_precision_init_val(tl.Linear(4, 4)) is None

    @pytest.mark.parametrize("name", NAMES)
    def test_dequantize_is_the_quantized_value(self, name):
        """Any op but the forward's reads the dequantized weight: within one quantization step of the init."""
        with tl.quantized_model_init(recipe=recipe.from_name(name), preserve_high_precision_init_val=True):
            layer = tl.Linear(256, 128)
        init = tl.get_high_precision_init_val(layer)
        deq = layer.weight.dequantize()
        assert type(deq) is torch.Tensor and deq.dtype == torch.float32
        # E4M3 keeps 3 mantissa bits (<= 1/16 relative), E2M1 one (<= 1/4 of the block's largest value).
        tol = 0.25 if recipe.quantization.quantization_spec(recipe.from_name(name)).weight.is_nvfp4 else 1 / 16
        err = (deq - init).abs()
        assert (err <= tol * init.abs().max()).all()
        assert torch.equal(layer.weight + 0, deq)  # a plain op runs on the dequantized weight
        if name != "mxfp8":
            # Requantizing the dequantized weight gives the same bits back (MXFP8's ceil-rounded E8M0 scale
            # of a block whose largest value is now a representable multiple can move up a power of two).
            again = quantized_init.quantize_weight(layer.weight.quantizer, deq)
            assert torch.equal(_bits(again.weight_fp8), _bits(layer.weight.weight_fp8))

    def test_in_place_ops_quantize_their_result(self):
        with tl.quantized_model_init(recipe=recipe.from_name("current")):
            layer = tl.Linear(32, 16)
        weight = layer.weight
        torch.manual_seed(3)
        nn.init.normal_(layer.weight)  # nn.init on the FP8 Parameter: the result quantized back in place
        assert layer.weight is weight and isinstance(weight, QuantizedWeight)
        torch.manual_seed(3)
        expected = quantized_init.quantize_weight(weight.quantizer, torch.empty(16, 32).normal_())
        assert torch.equal(_bits(weight.weight_fp8), _bits(expected.weight_fp8))

    def test_meta_device_then_materialized(self):
        rec = recipe.from_name("block")
        with tl.quantized_model_init(recipe=rec), torch.device("meta"):
            layer = tl.Linear(128, 128)
        assert layer.weight.is_meta and tl.quantized_weight_bytes(layer) == 0
        layer.to_empty(device="cpu")
        assert isinstance(layer.weight, QuantizedWeight)
        layer.reset_parameters()  # in-place init ops quantize
        x = torch.randn(4, 128)
        with tl.autocast(recipe=rec):
            out = layer(x)
        ref = tl.Linear(128, 128, recipe=rec)
        with torch.no_grad():
            ref.weight.copy_(layer.weight.dequantize())
            ref.bias.copy_(layer.bias)
        assert torch.equal(out, ref(x))


class TestTraining:
    @pytest.mark.parametrize("name", NAMES)
    def test_mlp_matches_high_precision_weights(self, name):
        rec = recipe.from_name(name)
        torch.manual_seed(0)
        batches = [(torch.randn(32, 64), torch.randn(32, 64)) for _ in range(4)]
        torch.manual_seed(1)
        plain = tl.convert_to_fp8(_mlp())
        torch.manual_seed(1)
        with tl.quantized_model_init(recipe=rec, preserve_high_precision_init_val=True):
            quantized = tl.convert_to_fp8(_mlp())
        # Both runs draw the same random numbers (NVFP4's stochastic rounding seeds come from the generator).
        torch.manual_seed(2)
        ref = _train(plain, rec, 4, batches, _mlp_loss, master_weights=False)
        torch.manual_seed(2)
        got = _train(quantized, rec, 4, batches, _mlp_loss, master_weights=True)
        if recipe.quantization.quantization_spec(rec).scale_from_history:
            # Delayed scaling: from the second step the stored weight's scale is its own amax, not the
            # history's, so the weights differ by FP8 rounding (measured 0.1 % of the loss); the first
            # step's scales agree (the empty history's first-step rule is the current amax).
            assert got[0] == ref[0]
            torch.testing.assert_close(got, ref, rtol=0.01, atol=0.0)
        else:
            assert got == ref  # the same quantizer on the same master weight: bitwise the same

    @pytest.mark.parametrize("preserve", [True, False], ids=["preserved_init", "dequantized_init"])
    @pytest.mark.parametrize("name", ["current", "delayed", "block", "mxfp8"])
    def test_gpt_trains(self, name, preserve):
        rec = recipe.from_name(name)
        cfg = GPTConfig.named("tiny")
        data = SyntheticText(cfg, seed=0)
        batches = [data.batch(8) for _ in range(6)]
        torch.manual_seed(0)
        plain = tl.convert_to_fp8(TinyGPT(cfg))
        torch.manual_seed(0)
        with tl.quantized_model_init(recipe=rec, preserve_high_precision_init_val=preserve):
            quantized = tl.convert_to_fp8(TinyGPT(cfg))

        def loss_fn(model, tokens):
            return lm_loss(model(tokens), tokens)

        ref = _train(plain, rec, 6, batches, loss_fn, master_weights=False)
        got = _train(quantized, rec, 6, batches, loss_fn, master_weights=True)
        if preserve and not recipe.quantization.quantization_spec(rec).scale_from_history:
            assert got == ref
        else:
            # A master started from the dequantized weight (or delayed scaling's own-amax weight scale):
            # losses agree to FP8 rounding (measured <= 0.3 %).
            torch.testing.assert_close(got, ref, rtol=0.01, atol=0.0)
        assert got[-1] < got[0]

    @pytest.mark.parametrize("name", ["mxfp8", "rowwise"])
    def test_gpt_trains_rowwise_only(self, name):
        """rowwise_only: the forward is bitwise the two-copy weight's; dgrad reads the stored weight
        quantized columnwise (one more rounding from the master), so losses agree to FP8 rounding."""
        rec = recipe.from_name(name)
        cfg = GPTConfig.named("tiny")
        data = SyntheticText(cfg, seed=0)
        batches = [data.batch(8) for _ in range(6)]
        runs = []
        for rowwise_only in (False, True):
            torch.manual_seed(0)
            with tl.quantized_model_init(recipe=rec, preserve_high_precision_init_val=True, rowwise_only=rowwise_only):
                model = tl.convert_to_fp8(TinyGPT(cfg))
            runs.append(_train(model, rec, 6, batches, lambda m, tokens: lm_loss(m(tokens), tokens), True))
        both, one = runs
        assert one[0] == both[0]  # the first forward reads the same rowwise copy
        torch.testing.assert_close(one, both, rtol=0.01, atol=0.0)
        assert one[-1] < one[0]

    def test_masters_get_the_gradients_and_requantize_the_weights(self):
        rec = recipe.from_name("current")
        with tl.quantized_model_init(recipe=rec, preserve_high_precision_init_val=True):
            layer = tl.Linear(16, 16)
        weight = layer.weight
        masters = tl.optim.MasterWeights(layer)
        master = masters.master_of(weight)
        assert master.dtype == torch.float32 and type(master) is nn.Parameter
        assert tl.get_high_precision_init_val(layer) is None  # it became the master
        params = masters.parameters()
        assert params[0] is master and params[1] is layer.bias
        opt = torch.optim.AdamW(params, lr=0.1)
        masters.attach(opt)
        before = master.detach().clone()
        with tl.autocast(recipe=rec):
            layer(torch.randn(4, 16)).sum().backward()
        grad = weight.grad
        opt.step()
        assert weight.grad is None and master.grad is grad  # handed over, not copied
        assert not torch.equal(master, before)
        assert layer.weight is weight  # requantized in place
        expected = quantized_init.quantize_weight(weight.quantizer, master.detach())
        assert torch.equal(_bits(weight.weight_fp8), _bits(expected.weight_fp8))

    @pytest.mark.parametrize("name", ["current", "mxfp8"])
    def test_without_a_recipe_runs_the_dequantized_weight(self, name):
        """Outside autocast (evaluation in high precision, a recipe turned off) the layer is nn.Linear on the
        dequantized weight, as GroupedLinear and Transformer Engine run it, and still trains its master."""
        with tl.quantized_model_init(recipe=recipe.from_name(name)):
            layer = tl.Linear(16, 8)
        masters = tl.optim.MasterWeights(layer)
        opt = torch.optim.SGD(masters.parameters(), lr=0.1)
        masters.attach(opt)
        x = torch.randn(4, 16, requires_grad=True)
        dequantized = layer.weight.dequantize().detach().requires_grad_()
        out = layer(x)
        expected = nn.functional.linear(x, dequantized, layer.bias)
        assert torch.equal(out, expected)
        out.square().sum().backward()
        expected.square().sum().backward()
        assert torch.equal(layer.weight.grad, dequantized.grad)
        opt.step()
        master = masters.master_of(layer.weight)
        assert torch.equal(master.detach(), dequantized.detach().add(dequantized.grad, alpha=-0.1))  # SGD's update

    def test_optimizer_state_carries_the_masters(self):
        rec = recipe.from_name("block")

        def build(seed):
            torch.manual_seed(seed)
            with tl.quantized_model_init(recipe=rec, preserve_high_precision_init_val=True):
                model = tl.convert_to_fp8(_mlp())
            masters = tl.optim.MasterWeights(model)
            opt = torch.optim.AdamW(masters.parameters(), lr=1e-2)
            return model, masters.attach(opt), opt

        model, masters, opt = build(0)
        batches = [(torch.randn(8, 64), torch.randn(8, 64)) for _ in range(3)]
        _step = lambda m, o, b: (_mlp_loss_under(m, rec, b).backward(), o.step(), o.zero_grad())  # noqa: E731
        _step(model, opt, batches[0])
        model_sd, opt_sd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        assert len(opt_sd["master_weights"]) == 2
        other, other_masters, other_opt = build(1)
        other.load_state_dict(model_sd)
        other_opt.load_state_dict(opt_sd)
        for (w, m), (w2, m2) in zip(masters.masters(), other_masters.masters()):
            assert torch.equal(m, m2) and torch.equal(_bits(w.weight_fp8), _bits(w2.weight_fp8))
        for b in batches[1:]:
            _step(model, opt, b)
            _step(other, other_opt, b)
        for (w, m), (w2, m2) in zip(masters.masters(), other_masters.masters()):
            assert torch.equal(m, m2)

    def test_optimizer_over_the_fp8_weights_raises(self):
        with tl.quantized_model_init(recipe=recipe.from_name("current")):
            layer = tl.Linear(16, 16)
        opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
        with pytest.raises(TypeError, match="MasterWeights"):
            opt.step()

    def test_delayed_scaling_state_updates(self):
        rec = recipe.from_name("delayed", amax_history_len=4)
        with tl.quantized_model_init(recipe=rec):
            layer = tl.Linear(16, 16, recipe=rec)
        for _ in range(2):
            layer(torch.randn(4, 16)).sum().backward()
        # The stored weight's amax is recorded in the weight column of the history, as a quantized one's is.
        history = layer.fp8_amax_history
        assert torch.equal(history[..., 1].max(), layer.weight.weight_amax)


def _mlp_loss_under(model, rec, batch):
    with tl.autocast(recipe=rec):
        return _mlp_loss(model, batch)


class TestCompile:
    # rowwise_only: the columnwise copy quantized in the forward from the stored weight traces into the graph.
    @pytest.mark.parametrize("name, rowwise_only", [("current", False), ("block", False), ("mxfp8", True)])
    def test_fullgraph(self, name, rowwise_only):
        rec = recipe.from_name(name)
        with tl.quantized_model_init(recipe=rec, rowwise_only=rowwise_only):
            layer = tl.Linear(64, 32, recipe=rec)
        x = torch.randn(8, 64, requires_grad=True)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        out = compiled(x)
        out.sum().backward()
        grad_w, grad_x = layer.weight.grad.clone(), x.grad.clone()
        layer.weight.grad, x.grad = None, None
        eager = layer(x)
        eager.sum().backward()
        assert torch.equal(out, eager)
        assert torch.equal(grad_w, layer.weight.grad) and torch.equal(grad_x, x.grad)


class TestStateDict:
    @pytest.mark.parametrize("name", ["current", "block", "mxfp8"])
    def test_round_trip_with_nn_linear(self, name):
        """state_dict saves the dequantized weight (the masters are the optimizer's): it loads into
        nn.Linear, which then computes what the FP8 weight represents; loading back quantizes."""
        rec = recipe.from_name(name)
        with tl.quantized_model_init(recipe=rec):
            quantized = tl.convert_to_fp8(_mlp())
        sd = quantized.state_dict()
        assert all(type(v) is torch.Tensor for v in sd.values())
        plain = _mlp()
        missing, unexpected = plain.load_state_dict(sd, strict=False)
        assert not missing and all(k.split(".")[-1].startswith("fp8_") for k in unexpected)
        assert torch.equal(plain[0].weight, quantized[0].weight.dequantize())
        assert torch.equal(plain[0].bias, quantized[0].bias)
        # Back: new weights are quantized into the same Parameter.
        torch.manual_seed(5)
        fresh = _mlp()
        weight = quantized[0].weight
        quantized.load_state_dict(fresh.state_dict(), strict=False)
        assert quantized[0].weight is weight
        expected = quantized_init.quantize_weight(weight.quantizer, fresh[0].weight)
        assert torch.equal(_bits(weight.weight_fp8), _bits(expected.weight_fp8))

    def test_deepcopy_and_to(self):
        with tl.quantized_model_init(recipe=recipe.from_name("current")):
            layer = tl.Linear(8, 8)
        clone = copy.deepcopy(layer)
        assert isinstance(clone.weight, QuantizedWeight) and isinstance(clone.weight, nn.Parameter)
        assert clone.weight.weight_fp8.data_ptr() != layer.weight.weight_fp8.data_ptr()
        assert torch.equal(_bits(clone.weight.weight_fp8), _bits(layer.weight.weight_fp8))
        layer.to(torch.bfloat16)
        assert isinstance(layer.weight, QuantizedWeight) and layer.weight.dtype == torch.bfloat16
        assert torch.equal(_bits(clone.weight.weight_fp8), _bits(layer.weight.weight_fp8))


def _ddp_rank(rank, world):
    """DDP over FP8 weights: its broadcast of rank 0's parameters reaches the FP8 data (copy_ quantizes),
    the all-reduced gradients reach the masters, and the ranks' weights stay equal."""
    rec = recipe.from_name("current")
    torch.manual_seed(rank)  # a different initial weight on each rank: DDP broadcasts rank 0's
    with tl.quantized_model_init(recipe=rec):
        layer = tl.Linear(32, 16, recipe=rec)
    model = DistributedDataParallel(layer)
    masters = tl.optim.MasterWeights(model)
    opt = torch.optim.AdamW(masters.parameters(), lr=0.1)
    masters.attach(opt)
    equal = []
    for step in range(3):
        weights = [torch.empty(16, 32) for _ in range(world)]
        dist.all_gather(weights, layer.weight.dequantize())
        equal.append(all(torch.equal(weights[0], w) for w in weights))
        torch.manual_seed(10 * step + rank)  # a different batch on each rank
        model(torch.randn(4, 32)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return equal


class TestDDP:
    def test_ranks_stay_in_sync(self):
        for equal in run_ranks(_ddp_rank, world_size=2, timeout=120.0):
            assert equal == [True, True, True]


class TestBadInput:
    def test_unknown_recipe(self):
        with pytest.raises(TypeError, match="quantized_model_init: 'recipe'"):
            with tl.quantized_model_init(recipe="mxfp8"):
                pass

    def test_bad_flags(self):
        with pytest.raises(TypeError, match="'enabled'"):
            with tl.quantized_model_init(enabled=1):
                pass
        with pytest.raises(TypeError, match="'preserve_high_precision_init_val'"):
            with tl.quantized_model_init(preserve_high_precision_init_val="yes"):
                pass
        with pytest.raises(TypeError, match="'rowwise_only' must be a bool"):
            with tl.quantized_model_init(rowwise_only=None):
                pass

    def test_forward_recipe_mismatch(self):
        with tl.quantized_model_init(recipe=recipe.from_name("mxfp8")):
            layer = tl.Linear(64, 32)
        with pytest.raises(ValueError, match="quantized_model_init's recipe"):
            with tl.autocast(recipe=recipe.from_name("current")):
                layer(torch.randn(4, 64))

    def test_master_weights_arguments(self):
        with pytest.raises(TypeError, match="'model'"):
            tl.optim.MasterWeights(object())
        with pytest.raises(ValueError, match="no FP8 weight"):
            tl.optim.MasterWeights(nn.Linear(2, 2))
        with tl.quantized_model_init(recipe=recipe.from_name("current")):
            layer = tl.Linear(16, 16)
        with pytest.raises(TypeError, match="'dtype'"):
            tl.optim.MasterWeights(layer, dtype=torch.int8)
        masters = tl.optim.MasterWeights(layer)
        with pytest.raises(TypeError, match="'optimizer'"):
            masters.attach(object())
        with pytest.raises(ValueError, match="every master"):
            masters.attach(torch.optim.AdamW([layer.bias], lr=0.1))
        with pytest.raises(KeyError, match="not an FP8 weight"):
            masters.master_of(layer.bias)

    def test_store_of_another_shape(self):
        with tl.quantized_model_init(recipe=recipe.from_name("current")):
            layer = tl.Linear(16, 8)
        with pytest.raises(ValueError, match=r"cannot store a \[8, 8\] weight"):
            layer.weight.quantize_(torch.randn(8, 8))
