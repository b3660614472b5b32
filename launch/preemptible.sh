#!/bin/bash
# launch/preemptible.sh, sourced by the sbatch wrappers: `preemptible OUT_DIR srun ...` runs the job step so that a
# preemption or the time limit loses no training. The wrappers ask SLURM for an early warning
# (#SBATCH --signal=B:USR2@600: USR2 to this batch shell 10 minutes before the end, and --requeue);
# on it the step keeps running, every rank is asked to save at the end of its current step and exit 0
# (OUT_DIR/stop, run_dir.py), and once the step has ended the job is requeued: the same command then
# resumes from that checkpoint (trainer.resume_mode=auto). A step longer than the warning loses it.
set -euo pipefail

preemptible() {
  local out_dir=$1 pid rc=0 requeue=0
  shift
  "$@" &
  pid=$!
  trap 'echo "SLURM asked to stop early: every rank saves after its step ($out_dir/stop)"; touch "$out_dir/stop"; requeue=1' USR2
  wait "$pid" || rc=$?
  while kill -0 "$pid" 2>/dev/null; do  # a trapped signal ends `wait` early: wait on for the step
    rc=0
    wait "$pid" || rc=$?
  done
  trap - USR2
  if [[ $requeue == 1 && $rc == 0 ]]; then
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$rc"
}
