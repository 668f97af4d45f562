#!/usr/bin/env bash
#SBATCH --job-name=stare_lightning
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=48:00:00
# One task per GPU. Lightning's SLURMEnvironment reads ranks and the master address from SLURM.
# Usage: sbatch scripts/slurm_fit.sh experiment=paper_7b_short_cot [more overrides]
# PYTHON: the interpreter of the environment `make install` built (default: python on PATH).
set -euo pipefail
srun "${PYTHON:-python}" -m stare_lightning fit trainer=fsdp \
  trainer.devices="${SLURM_NTASKS_PER_NODE}" trainer.num_nodes="${SLURM_NNODES}" \
  output_dir="${OUTPUT_DIR:-$PWD/runs/$SLURM_JOB_ID}" "$@"
