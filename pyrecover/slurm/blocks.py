"""The fixed bash of the job script (render.py fills in the values around it).

It runs in the batch shell, outside the container, so the image needs no SLURM commands.
signals_block.py's SIGNALS_BLOCK comes first: the handlers and `wait_step`. `REQUEUE_BLOCK`
decides, after a training step, whether the job requeues; `NODES_BLOCK` keeps the run's bad
nodes, picks each step's nodes and restarts a step inside the
allocation. Both read the trainer's records in events.jsonl by a regex that relies on the
key order rundir.RunDir.event writes: event, time, the fields, job_id, restart_count,
in_job_restart. Every grep of events.jsonl is `grep -a`: a node that died while appending can
leave NUL bytes in it, and GNU grep then takes the whole file for binary and prints no line
(the restart limit would never be reached).
"""

REQUEUE_BLOCK = r"""# The trainer also stops by itself when the next steps and a checkpoint would
# not fit before the job ends. SLURM 22.05 sets no SLURM_JOB_END_TIME: ask squeue here.
if [ -z "${SLURM_JOB_END_TIME:-}" ]; then
    end=$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null)
    PYRECOVER_JOB_END_TIME=$(date -d "$end" +%s 2>/dev/null || true)
    export PYRECOVER_JOB_END_TIME
fi

# ---- after the training step: the requeue decision ----------------------------------
# Exit 0: finished. 2: a config, data or training error (a diverged loss), which a
# requeue cannot fix. 75: stopped cleanly with a checkpoint (signal or deadline). 76: a rank
# hung (the watchdog fired), a crash recorded as hang. 77: a task's health check failed.
# Anything else: a crash. A clean stop that trained some steps always requeues (a long run
# stops at every time limit); a failure, or a clean stop that made no progress (a stop that
# repeats at once), requeues while this job's earlier failures are fewer than MAX_RESTARTS.
# Each decision is recorded.
record() {
    local fmt='{"event": "%s", "time": %s, "job_id": "%s", "restart_count": %s, '
    fmt+='"in_job_restart": %s, "exit_code": %s, "reason": "%s"}\n'
    # shellcheck disable=SC2059
    printf "$fmt" "$1" "$(date +%s)" "$SLURM_JOB_ID" "${SLURM_RESTART_COUNT:-0}" "$IN_JOB" \
        "$2" "$3" >> "$EVENTS"
}
# This step's own records: the job, the requeue and the step inside the allocation (a
# trainer without in-job restarts writes no in_job_restart: step 0; no other key after
# restart_count begins with "i").
this_step() {
    local step=', "in_job_restart": '"$IN_JOB"'(, "[^i]|})'
    [ "$IN_JOB" -gt 0 ] || step='(, "in_job_restart": 0)?(, "[^i]|})'
    printf '"job_id": "%s", "restart_count": %s%s' "$SLURM_JOB_ID" \
        "${SLURM_RESTART_COUNT:-0}" "$step"
}
# srun returns the highest code of its tasks, and with --kill-on-bad-exit the first task to
# exit (75 or 2 is non-zero too) gets the others SIGTERMed, often while they are still
# shutting down: 143. The trainer's own record of this step tells what really happened.
attempt_outcome() {
    grep -aE "^\{\"event\": \"(stop|error|hang|health|finish)\".*$(this_step)" "$EVENTS" \
        2>/dev/null |
        grep -av '^{"event": "health", "time": [0-9.]*, "ok": true' | tail -n 1 |
        sed -E 's/^\{"event": "([a-z]+)".*/\1/'
}
# resolve_code prints the step's exit code, corrected by its own record where SLURM ended it,
# and 0 where the trainer recorded this step's finish (after its final checkpoint) and a
# task failed after that, in its teardown: a requeue would redo nothing.
resolve_code() {
    local code=$1 outcome
    [ "$code" -ne 0 ] || { echo 0; return; }
    outcome=$(attempt_outcome)
    if [ "$outcome" = finish ]; then
        echo "pyrecover: a task exited with code $code after the trainer recorded this" \
            "attempt's finish; taking it as finished" >&2
        echo 0
        return
    fi
    if [ "$code" -gt 128 ]; then
        case $outcome in
            stop) code=75 ;;
            error) code=2 ;;
            hang) code=76 ;;
            health) code=77 ;;
        esac
        [ "$code" -gt 128 ] || echo "pyrecover: a task was ended by SLURM after the" \
            "trainer recorded this attempt's outcome; taking it as exit code $code" >&2
    fi
    echo "$code"
}
# failures prints how many of this job's requeues so far were failures (the script's own
# requeue records: every reason but a clean stop).
failures() {
    grep -aE "^\{\"event\": \"requeue\", \"time\": [0-9.]+, \"job_id\": \"$SLURM_JOB_ID\", " \
        "$EVENTS" 2>/dev/null | grep -acv '"reason": "stopped cleanly"}$'
}
# progressed: this step's stop record names a later step than its start or resume record.
progressed() {
    local began stopped number='s/^\{"event": "[a-z]+", "time": [0-9.]+, "step": ([0-9]+), .*/\1/'
    began=$(grep -aE "^\{\"event\": \"(start|resume)\", .*$(this_step)" "$EVENTS" 2>/dev/null |
        tail -n 1 | sed -nE "${number}p")
    stopped=$(grep -aE "^\{\"event\": \"stop\", .*$(this_step)" "$EVENTS" 2>/dev/null |
        tail -n 1 | sed -nE "${number}p")
    [ -n "$began" ] && [ -n "$stopped" ] && [ "$stopped" -gt "$began" ]
}
reason_for() {
    case $1 in
        75) echo "stopped cleanly" ;;
        76) echo hang ;;
        77) echo "health check failed" ;;
        *) echo crash ;;
    esac
}
# job_record prints SLURM's one-line record of this job (empty where scontrol fails).
job_record() { scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null; }
# cancelled: the job was made non-requeueable (`pyrecover cancel` does that before scancel,
# whose SIGTERM the trainer takes as a stop: it saves, and the job must then end, not requeue).
cancelled() { job_record | grep -q ' Requeue=0 '; }
# after_training ends the job for a resolved exit code: done, or requeued, or given up.
after_training() {
    local code=$1 reason failed exclude excluded
    reason=$(reason_for "$code")
    case $code in
        0) exit 0 ;;
        2) record no_requeue "$code" "config, data or training error"; exit 2 ;;
    esac
    if cancelled; then
        record no_requeue "$code" "cancelled; the job may not requeue"
        exit "$code"
    fi
    if [ "$code" -eq 75 ] && ! progressed; then
        reason="stopped cleanly without progress"  # a failure: it would loop forever
    fi
    failed=$(failures)
    if [ "$reason" != "stopped cleanly" ] && [ "${failed:-0}" -ge "$MAX_RESTARTS" ]; then
        record no_requeue "$code" "$reason; max restarts ($MAX_RESTARTS) reached by failures"
        exit "$code"
    fi
    if ! record requeue "$code" "$reason" && [ "$reason" != "stopped cleanly" ]; then
        # Uncounted, a failure would requeue for ever: the restart limit reads these records.
        # (A clean stop that trained is never counted: it requeues all the same.)
        echo "pyrecover: cannot write $EVENTS (storage full, over quota or read-only?), so" \
            "this requeue could not be counted; not requeueing. Free the storage, then launch" \
            "the run again" >&2
        exit "$code"
    fi
    exclude=$(exclusion_for_requeue)  # before the requeue, whose SIGTERM may cut it short
    excluded=$(job_record | sed -nE 's/.* ExcNodeList=([^ ]*).*/\1/p')
    echo "pyrecover: requeueing job $SLURM_JOB_ID ($reason)" >&2
    scontrol requeue "$SLURM_JOB_ID"
    exclude_on_requeue "$exclude" "$excluded"
    exit "$code"
}
# -------------------------------------------------------------------------------------"""


NODES_BLOCK = r"""# ---- nodes: bad ones are left out, a failed step restarts here --------------
# BAD_NODES holds one line per node: name, UTC time, reason (tab-separated). A node goes in
# after a failed health check, a hang it reported outside any collective, or a task on it
# killed by a signal (srun's own report in this job's log); `pyrecover status` lists them
# and `pyrecover status RUN_DIR --clear-bad-nodes` empties the list.
bad_nodes() { cut -f1 "$BAD_NODES" 2>/dev/null | sort -u; }
# allocation prints the job's nodes now: a --no-kill job (spare nodes) loses a failed node
# from SLURM's record of it, while SLURM_JOB_NODELIST keeps the nodes it started with.
allocation() {
    local now
    now=$(job_record | sed -nE 's/.* NodeList=([^ ]+).*/\1/p')
    [ -n "$now" ] && [ "$now" != "(null)" ] || now=$SLURM_JOB_NODELIST
    scontrol show hostnames "$now"
}
healthy_count() { allocation | grep -cvxF -f <(bad_nodes); }
# STORAGE_SUSPECTS: the last step's nodes where a storage write failed on every one of them,
# blamed on none (it may be the shared storage); the next step here tries other nodes first,
# and where its health check passes there, the storage works and they are excluded.
# STORAGE_AT_FAULT=1: a storage write failed on every node of two steps, the storage's fault.
STORAGE_SUSPECTS="" STORAGE_AT_FAULT=0
# step_nodes prints NODES nodes of the allocation, comma-separated: healthy ones first (the
# storage suspects last among them), a known bad one only where too few healthy ones are
# left; listed in the allocation's order, which is how srun places the ranks (it ignores
# --nodelist's order), so the first is rank 0's node: the rendezvous host.
step_nodes() {
    local chosen
    chosen=$({ allocation | grep -vxF -f <(bad_nodes; tr ' ' '\n' <<< "$STORAGE_SUSPECTS")
        allocation | grep -xF -f <(tr ' ' '\n' <<< "$STORAGE_SUSPECTS") |
            grep -vxF -f <(bad_nodes)
        allocation | grep -xF -f <(bad_nodes); } | head -n "$NODES")
    allocation | grep -xF -f <(printf '%s\n' "$chosen") | paste -sd, -
}
start_step() {
    STEP_NODES=$(step_nodes)
    MASTER_ADDR=${STEP_NODES%%,*}
    PYRECOVER_IN_JOB_RESTART=$IN_JOB
    export MASTER_ADDR PYRECOVER_IN_JOB_RESTART
    LOG_OFFSET=$(stat -c %s "$JOB_LOG" 2>/dev/null || echo 0)
}
# suspects prints "node<TAB>reason" for each node this step's failure points at.
suspects() {
    # The node's own checks (health.NODE_CHECKS): a full shared storage or a collective
    # that does not complete is no one node's fault, nor is a storage write that failed on
    # every node of the step: the shared storage's.
    local node='"node": "([A-Za-z0-9._-]+)"' check='(gpu|memory|storage_write)' failed
    failed=$(health_failures |
        sed -nE "s/.*$node, \"check\": \"$check\".*/\1\thealth check failed: \2/p")
    if [ -z "$(storage_suspects)" ]; then
        [ -z "$failed" ] || printf '%s\n' "$failed"
    else
        sed '/storage_write$/d; /^$/d' <<< "$failed"
    fi
    # A rank stuck outside any collective reports its own hang; ranks waiting in one do not
    # name the culprit.
    grep -aE "^\{\"event\": \"hang\".*$(this_step)" "$EVENTS" 2>/dev/null |
        sed -nE "s/.*$node, \"phase\": \"(data|forward|optimizer)\".*/\1\thang in phase \2/p"
    # A rank that stopped altogether (SIGSTOP, a frozen node) cannot report; the peers that
    # report the hang name it when its heartbeat stopped (pyrecover/heartbeat.py).
    grep -aE "^\{\"event\": \"hang\".*$(this_step)" "$EVENTS" 2>/dev/null |
        sed -nE 's/.*"suspect_node": "([A-Za-z0-9._-]+)", "stacks": ".*/\1\tsilent in a hang/p'
    # A node SLURM found failed ("srun: error: Node failure on node2"): the step's tasks that
    # srun killed after it, on any node, are no evidence.
    local lost
    lost=$(tail -c +"$((LOG_OFFSET + 1))" "$JOB_LOG" 2>/dev/null |
        sed -nE 's/^srun: error: Node failure on ([A-Za-z0-9._-]+).*/\1\tnode failure/p')
    if [ -n "$lost" ]; then
        printf '%s\n' "$lost"
        return 0
    fi
    # srun names the first task a signal killed ("srun: error: node2: task 1: Killed"), before
    # it ends the step's other tasks itself (SIGKILL too, reported after "Terminating").
    local signal='(Killed|Segmentation fault|Bus error|Aborted|Illegal instruction)'
    tail -c +"$((LOG_OFFSET + 1))" "$JOB_LOG" 2>/dev/null |
        sed -nE -e '/^srun: .*(Terminating|Force Terminated) StepId/q' \
            -e "s/^srun: error: ([A-Za-z0-9._-]+): tasks? [0-9,-]+: $signal.*/\1\ttask \2/p" |
        head -n 1
}
health_failures() {
    grep -aE "^\{\"event\": \"health\", \"time\": [0-9.]+, \"ok\": false.*$(this_step)" \
        "$EVENTS" 2>/dev/null
}
# storage_suspects prints this step's nodes, one per line, when a storage write failed on
# every one of them; nothing otherwise.
storage_suspects() {
    local failed
    failed=$(health_failures |
        sed -nE 's/.*"node": "([A-Za-z0-9._-]+)", "check": "storage_write".*/\1/p')
    [ -n "$failed" ] || return 0
    tr ',' '\n' <<< "$STEP_NODES" | grep -qvxF -f <(printf '%s\n' "$failed") ||
        tr ',' '\n' <<< "$STEP_NODES"
}
# blame_storage_suspects excludes the last step's storage suspects that this step left out
# where this step's health check passed: the storage took its writes from other nodes. Where
# it passed with a suspect among this step's nodes, the storage took that suspect's writes
# too: the fault passed, and none is blamed. Where a storage write failed on every node of
# this step too, the storage is at fault: no suspect is blamed or avoided for the rest of
# the job.
blame_storage_suspects() {
    local suspect now more=""
    [ "$STORAGE_AT_FAULT" = 0 ] || return 0
    if [ -n "$STORAGE_SUSPECTS" ] &&
        ! tr ',' '\n' <<< "$STEP_NODES" | grep -qxF -f <(tr ' ' '\n' <<< "$STORAGE_SUSPECTS") &&
        grep -qaE "^\{\"event\": \"health\", \"time\": [0-9.]+, \"ok\": true.*$(this_step)" \
            "$EVENTS" 2>/dev/null; then
        for suspect in $STORAGE_SUSPECTS; do
            exclude_node "$suspect" "health check failed: storage_write (passed on $STEP_NODES)"
        done
    fi
    now=$(storage_suspects | paste -sd' ' -)
    if [ -n "$STORAGE_SUSPECTS" ] && [ -n "$now" ]; then
        STORAGE_AT_FAULT=1 STORAGE_SUSPECTS=""
        echo "pyrecover: a storage write failed on every node of two steps: the storage's" \
            "fault, no node is excluded for it" >&2
        return 0
    fi
    STORAGE_SUSPECTS=$now
    [ -n "$now" ] || return 0
    [ "$SPARES" -eq 0 ] || more="; a restart here tries other nodes first, and excludes these"
    echo "pyrecover: a storage write failed on every node of this step ($STEP_NODES): none is" \
        "excluded, it may be the shared storage${more:+$more where the storage works there}" >&2
}
exclude_node() {
    if bad_nodes | grep -qxF "$1"; then
        return 0
    fi
    printf '%s\t%s\t%s\n' "$1" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$2" >> "$BAD_NODES"
    echo "pyrecover: node $1 is excluded from this run: $2" >&2
}
# usable_nodes prints the partition's nodes that can run jobs: responding, in a state that
# takes jobs, not draining or drained (`sinfo -t idle` lists idle+drain ones too).
usable_nodes() {
    sinfo -h -N -r -t idle,mixed,allocated,completing -o '%N %T' \
        -p "${SLURM_JOB_PARTITION:-}" 2>/dev/null |
        awk '$2 !~ /drain|fail|maint/ { print $1 }' | sort -u
}
# exclusion_for_requeue prints the nodes the requeued job excludes, comma-separated: the
# profile's own (SITE_EXCLUDE, its sbatch_extra --exclude, which the update replaces) and the
# run's bad nodes, these only where enough usable nodes of the partition are left to start.
exclusion_for_requeue() {
    local list left
    list=$(bad_nodes | paste -sd, -)
    if [ -n "$list" ]; then
        left=$(usable_nodes | grep -cvxF -f <(bad_nodes; site_excluded))
        if [ "${left:-0}" -lt $((NODES + SPARES)) ]; then
            echo "pyrecover: not excluding $list from the requeued job: only ${left:-0} other" \
                "usable nodes in its partition, it needs $((NODES + SPARES))" >&2
            list=""
        fi
    fi
    echo "$SITE_EXCLUDE${SITE_EXCLUDE:+${list:+,}}$list"
}
# site_excluded prints the nodes of SITE_EXCLUDE (a SLURM hostlist), one per line.
site_excluded() {
    [ -z "$SITE_EXCLUDE" ] || scontrol show hostnames "$SITE_EXCLUDE" 2>/dev/null
}
# exclude_on_requeue sets the requeued job's excluded nodes to $1 where they are not that
# already ($2, as SLURM had them). SLURM keeps a job's ExcNodeList across requeues, so an
# emptier list is set too (bad nodes cleared, or too little room left to exclude them), or
# the old exclusion would stay for good. SLURM refuses the update for a running job but
# takes it once `scontrol requeue` has ended this one (whose SIGTERM the handler above
# survives), so it runs right after the requeue, a few tries while SLURM updates the job and
# the SIGTERM may end a try.
exclude_on_requeue() {
    local list=$1 now=${2:-}
    [ "$now" != "(null)" ] || now=""
    [ "$list" != "$now" ] || return 0
    for _ in 1 2 3 4 5 6; do
        if scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$list" 2>/dev/null; then
            echo "pyrecover: the requeued job excludes ${list:-no node}" >&2
            return 0
        fi
        sleep 0.5
    done
    echo "pyrecover: could not set the requeued job's excluded nodes to $list" >&2
}
# after_step ends the job (after_training) or returns to start another step here: after a
# crash, hang or failed health check, with spare nodes, while MAX_RESTARTS_IN_JOB allows and
# enough healthy nodes are left in the allocation.
after_step() {
    local code reason node why
    code=$(resolve_code "$1")
    echo "pyrecover: training exited with code $code (restart ${SLURM_RESTART_COUNT:-0}," \
        "$(failures) failures of at most $MAX_RESTARTS, $IN_JOB of $MAX_RESTARTS_IN_JOB in" \
        "this job)" >&2
    blame_storage_suspects
    case $code in
        0 | 2 | 75) after_training "$code" ;;
    esac
    cancelled && after_training "$code"
    while IFS=$'\t' read -r node why; do
        exclude_node "$node" "$why"
    done < <(suspects)
    if [ "$SPARES" -gt 0 ] && [ "$IN_JOB" -lt "$MAX_RESTARTS_IN_JOB" ] &&
        [ "$(healthy_count)" -ge "$NODES" ]; then
        reason=$(reason_for "$code")
        record restart_in_job "$code" "$reason"
        IN_JOB=$((IN_JOB + 1))
        echo "pyrecover: restarting inside the allocation ($reason)" >&2
        return 0
    fi
    after_training "$code"
}
# -------------------------------------------------------------------------------------"""
