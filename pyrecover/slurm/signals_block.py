"""The job script's signal handling (render.py puts it before blocks.py's bash): the batch
shell survives SIGTERM and the stop signal, passes each on to the training step, and waits
for the step in the background (`wait_step`) so that its handlers run meanwhile."""

SIGNALS_BLOCK = r"""# ---- signals: stop the training step, then decide ---------------------------
# SIGTERM is a preemption notice: the training step saves on it and stops, and this shell
# decides afterwards (SIGTERM would end it by default, with no requeue decision). Preemption
# and scancel send it to the tasks too; sent to this shell alone (`scancel -s TERM --batch`,
# as some sites preempt), it reaches no task: the handler passes it on to the step's tasks
# through SLURM (to the step's own id: an array task's SLURM_JOB_ID may be the array's),
# not to srun, which answers SIGTERM by killing its tasks unsaved. Sent to the whole job,
# the tasks get it twice: one stop. `scontrol requeue` sends it as well, after the step:
# the handler keeps this shell alive long enough to set the requeued job's excluded nodes.
STEP_PID=
STOP_PENDING=
TERM_PENDING=
relay_term() {
    echo "pyrecover: batch shell got SIGTERM; passing it on to the training step" >&2
    if [ -n "$STEP_PID" ]; then
        term_step
    else
        TERM_PENDING=1
    fi
}
# term_step sends SIGTERM to the job's running steps; false where SLURM lists none yet.
term_step() {
    local step steps
    steps=$(squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null | sed -nE 's/.*\.([0-9]+)$/\1/p')
    for step in $steps; do
        timeout 10 scancel --signal=TERM "$SLURM_JOB_ID.$step" 2>/dev/null
    done
    [ -n "$steps" ]
}
trap relay_term TERM
# The stop signal would end this shell by default too. Sent to this shell alone (`scancel -s
# USR2 --batch`), it reaches no task: the handler passes it on to the step's srun, which
# hands it to every task (sent to the whole job, `--full`, the tasks get it twice: one
# stop). One that comes between steps goes to the next step, as does a SIGTERM.
relay_stop() {
    echo "pyrecover: batch shell got SIG$STOP_SIGNAL; passing it on to the training step" >&2
    if [ -n "$STEP_PID" ]; then
        kill -s "$STOP_SIGNAL" "$STEP_PID" 2>/dev/null
    else
        STOP_PENDING=1
    fi
}
[ "$STOP_SIGNAL" = TERM ] || trap relay_stop "$STOP_SIGNAL"
# wait_step returns the exit code of the step started in the background as process $1: in
# the foreground, bash would run the handlers above only once the step had ended.
wait_step() {
    local code again
    STEP_PID=$1
    if [ -n "$STOP_PENDING" ]; then
        STOP_PENDING=
        kill -s "$STOP_SIGNAL" "$STEP_PID" 2>/dev/null
    fi
    if [ -n "$TERM_PENDING" ]; then  # once SLURM lists the new step
        TERM_PENDING=
        for _ in 1 2 3 4 5 6 7 8 9 10; do term_step && break; sleep 1; done
    fi
    wait "$STEP_PID"
    code=$?
    while kill -0 "$STEP_PID" 2>/dev/null; do  # a handler ended the wait; the step runs on
        wait "$STEP_PID"
        code=$?
    done
    # The step ended as a handler ran (a code above 128): bash keeps the step's own code for
    # one more wait (127 where it has none left to give).
    if [ "$code" -gt 128 ]; then
        wait "$STEP_PID" 2>/dev/null
        again=$?
        [ "$again" -eq 127 ] || code=$again
    fi
    STEP_PID=
    return "$code"
}"""
