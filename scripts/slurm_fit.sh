#!/usr/bin/env bash
#SBATCH --job-name=stare_lightning
#SBATCH --nodes=2
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
# FSDP2 over the allocation: one training process per GPU a node has in this job, one per node on CPU nodes.
# --exclusive gives the job every CPU and all the memory of its nodes, whatever they have, so no per-task CPU count
# can leave the job waiting for CPUs no node offers. The trainer's master address is the first node of its own step.
# Usage: sbatch scripts/slurm_fit.sh experiment=paper_7b_short_cot [more overrides]
#        sbatch --gpus-per-node=0 scripts/slurm_fit.sh ...   (CPU nodes)
# PYTHON: the interpreter of the environment `make install` built (default: python on PATH).
# OUTPUT_DIR: where the run writes (default runs/<job id>); every node must see it (a shared file system).
set -euo pipefail
# The GPUs this job holds on each node (SLURM sets the count when it allocated any): one process each, else one.
GPUS=${SLURM_GPUS_ON_NODE:-0}
if ((GPUS > 0)); then TASKS=$GPUS DEVICE=(); else TASKS=1 DEVICE=(trainer.accelerator=cpu); fi
# A rank that dies ends the others at once (--kill-on-bad-exit) instead of leaving them at a collective: resubmit
# with ckpt_path=last to go on from the last checkpoint.
srun --kill-on-bad-exit=1 --nodes="$SLURM_NNODES" --ntasks-per-node="$TASKS" "${PYTHON:-python}" -m stare_lightning fit trainer=fsdp \
  trainer.devices="$TASKS" trainer.num_nodes="$SLURM_NNODES" "${DEVICE[@]}" \
  output_dir="${OUTPUT_DIR:-$PWD/runs/$SLURM_JOB_ID}" "$@"
