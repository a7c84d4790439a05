#!/usr/bin/env bash
# examples/keras_mnist_horovod.py as a SLURM batch job: one Horovod job over the allocation.
#
#   sbatch examples/slurm_job.sh                          # from the repository's root
#   sbatch --nodes=4 examples/slurm_job.sh --epochs 48    # arguments go to the script
#   HVD_BALANCE_VENV=$PWD/.venv sbatch examples/slurm_job.sh
#
# scripts/slurm/hvd_balance.sbatch turns the allocation into `horovodrun -np N -H
# node1:k,node2:k ...` (hosts and ranks per node from SLURM) and gives each rank one device:
# a GPU each while a node has GPUs, its other ranks on the CPU (HVD_BALANCE_DEVICES=auto).
# It activates HVD_BALANCE_VENV if set; HOROVODRUN_ARGS adds horovodrun options (e.g.
# '--gloo --network-interface ib0'); HVD_BALANCE_DRY_RUN=1 prints the command instead.
#
#SBATCH --job-name=keras-mnist
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
# On GPU nodes, remove one '#' below (one rank per GPU; ranks beyond the GPUs use the CPU).
##SBATCH --gres=gpu:4
#SBATCH --time=00:30:00
#SBATCH --output=%x-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"  # sbatch runs a copy of this file; paths are the submit folder's
exec bash scripts/slurm/hvd_balance.sbatch python examples/keras_mnist_horovod.py "$@"
