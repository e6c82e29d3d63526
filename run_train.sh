#!/usr/bin/env bash
# Train with torchrun on this machine.
#
#   ./run_train.sh                                   # the CPU demo (train_configs/debug_model.toml)
#   NGPU=8 CONFIG_FILE=train_configs/llama7b.toml ./run_train.sh
#   ./run_train.sh --training.steps 100              # extra arguments go to the trainer
#   FT_GROUPS=2 NGPU=8 ./run_train.sh                # fault tolerance: 2 replica groups of 4 ranks
#
# Environment:
#   NGPU         processes to start (default: the GPUs nvidia-smi lists, else 2 CPU processes)
#   LOG_RANK     comma-separated ranks that print their log (default 0)
#   CONFIG_FILE  TOML config (default: this checkout's train_configs/debug_model.toml)
#   PYTHON       interpreter to use (default python3)
#   FT_GROUPS    fault tolerance (docs/reliability.md): start this many replica groups, each a
#                torchrun of NGPU / FT_GROUPS ranks on its own GPUs, and torchft's lighthouse
#                (on FT_LIGHTHOUSE_PORT, default 29510; 0 lets the kernel pick one) unless
#                TORCHFT_LIGHTHOUSE names a running one
#   FT_GROUP     with FT_GROUPS: start only this group (a restart; it heals from the live ones)
#
# Also set for the ranks: PYTORCH_ALLOC_CONF=expandable_segments:True, unless PYTORCH_ALLOC_CONF,
# PYTORCH_CUDA_ALLOC_CONF or PYTORCH_HIP_ALLOC_CONF is set (even empty). After a SIGTERM,
# torchrun gives the ranks checkpoint.stop_save_seconds to save before it kills them.
#
# The run starts in the caller's folder, as torchtitan's script does: relative paths in the
# config (dump_folder, hf_assets_path, dataset_path, checkpoint folders) are relative to it.
set -euo pipefail

checkout="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
CONFIG_FILE="${CONFIG_FILE:-$checkout/train_configs/debug_model.toml}"
export LOG_RANK="${LOG_RANK:-0}"

gpu_count=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpu_count="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi
if [[ -z "${NGPU:-}" ]]; then
    if (( gpu_count > 0 )); then NGPU="$gpu_count"; else NGPU=2; fi
fi
if (( gpu_count == 0 )) && [[ -z "${OMP_NUM_THREADS:-}" ]]; then
    # CPU ranks split the cores between them instead of each starting a thread per core
    # (2 ranks on 2 cores: about 20% less wall time than with 2 threads each).
    cores="$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
    export OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
fi

# Checked from / so that the checkout itself (the current folder) does not count as installed.
if ! (cd / && "$PYTHON" -c "import titanlite") >/dev/null 2>&1; then
    echo "run_train.sh: titanlite is not installed; installing it with pip install -e $checkout"
    "$PYTHON" -m pip install -e "$checkout"
fi

# This checkout's trainer, whichever titanlite pip installed (another clone's, say): its
# folder goes first on the path of every process started below.
export PYTHONPATH="$checkout${PYTHONPATH:+:$PYTHONPATH}"

# --help needs no processes; a run that only validates is done after the preflight.
validate_only=false
arguments=("$@")
for (( i = 0; i < ${#arguments[@]}; i++ )); do
    case "${arguments[i]}" in
        -h|--help) exec "$PYTHON" -m titanlite.train "$@" ;;
        --job.validate_only=*) validate_only="${arguments[i]#*=}" ;;
        --job.validate_only)
            # A bare boolean option means true; an explicit true/false may follow it.
            case "${arguments[i + 1]:-}" in
                [Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee]) validate_only="${arguments[i + 1]}" ;;
                *) validate_only=true ;;
            esac ;;
    esac
done

# Fault tolerance: the groups' flags, and the lighthouse they all talk to (started here unless
# TORCHFT_LIGHTHOUSE names one), which the preflight checks too.
ft_groups="${FT_GROUPS:-0}"
group_ranks="$NGPU"
ft_flags=()
if (( ft_groups > 0 )); then
    if (( NGPU % ft_groups != 0 )); then
        echo "run_train.sh: NGPU ($NGPU) must be a multiple of FT_GROUPS ($ft_groups)" >&2
        exit 2
    fi
    group_ranks=$(( NGPU / ft_groups ))
    # torchft brings the lighthouse and the groups' manager; without it nothing below runs.
    if ! "$PYTHON" -c "import torchft" >/dev/null 2>&1; then
        echo "run_train.sh: FT_GROUPS needs torchft, which $PYTHON cannot import; install it with pip install 'titanlite[ft]'" >&2
        exit 2
    fi
    ft_flags=(--fault_tolerance.enable --fault_tolerance.group_size "$ft_groups")
    if [[ -z "${TORCHFT_LIGHTHOUSE:-}" ]]; then
        port="${FT_LIGHTHOUSE_PORT:-29510}"
        lighthouse_log="$(mktemp -t titanlite-lighthouse.XXXXXX)"
        torchft_lighthouse --min_replicas 1 --bind "[::]:$port" >"$lighthouse_log" 2>&1 &
        lighthouse_pid=$!
        trap 'kill "$lighthouse_pid" 2>/dev/null; wait "$lighthouse_pid" 2>/dev/null || true' EXIT
        for _ in $(seq 300); do
            grep -q "listening on" "$lighthouse_log" && break
            kill -0 "$lighthouse_pid" 2>/dev/null || { cat "$lighthouse_log" >&2; exit 1; }
            sleep 0.1
        done
        port="$(sed -n 's|.*listening on: http://[^ ]*:\([0-9][0-9]*\).*|\1|p' "$lighthouse_log" | head -n 1)"
        export TORCHFT_LIGHTHOUSE="http://localhost:$port"
        echo "run_train.sh: torchft lighthouse at $TORCHFT_LIGHTHOUSE (log: $lighthouse_log)"
    fi
fi

# Preflight in one process: a config mistake prints one line here, instead of one
# failure per rank followed by torchrun's long report.
# Without GPUs the ranks train on this host, so its memory is the one to check.
cpu_flags=()
if (( gpu_count == 0 )); then cpu_flags=(--job.validate_hardware cpu); fi
status=0
WORLD_SIZE="$group_ranks" "$PYTHON" -m titanlite.train --job.config_file "$CONFIG_FILE" ${cpu_flags[@]+"${cpu_flags[@]}"} "$@" \
    ${ft_flags[@]+"${ft_flags[@]}"} ${ft_flags[@]+--fault_tolerance.replica_id "${FT_GROUP:-0}"} \
    --job.validate_only || status=$?
if (( status != 0 )) || [[ "$validate_only" == [Tt][Rr][Uu][Ee] ]]; then
    exit "$status"
fi

# The preflight has shown the config's warnings; the ranks need not repeat them.
export TITANLITE_CONFIG_WARNINGS_SHOWN=1

# On SIGTERM torchrun passes the signal on to the ranks and SIGKILLs those still running
# after its shutdown timeout (30 s unless told otherwise), too short for the ranks to save a
# large model. The time comes from the resolved config, file and command line alike.
stop_save_seconds="$("$PYTHON" -m titanlite.config --job.config_file "$CONFIG_FILE" "$@" --get checkpoint.stop_save_seconds)"

# With expandable segments the CUDA caching allocator maps memory into segments that grow,
# instead of one cudaMalloc per large request, so memory freed by one size of tensor serves
# other sizes: less fragmentation, fewer out-of-memory errors with memory still free.
# A setting of the user's own, in this variable or the older device-specific ones, is kept
# (even an empty one, the way to opt out); on machines without CUDA it has no effect.
if [[ -z "${PYTORCH_ALLOC_CONF+set}${PYTORCH_CUDA_ALLOC_CONF+set}${PYTORCH_HIP_ALLOC_CONF+set}" ]]; then
    export PYTORCH_ALLOC_CONF="expandable_segments:True"
fi

torchrun_args=(--nproc_per_node="$group_ranks" --rdzv_backend c10d --rdzv_endpoint="localhost:0"
    --shutdown-timeout "$stop_save_seconds" -m titanlite.train --job.config_file "$CONFIG_FILE")
if (( ft_groups == 0 )); then
    exec torchrun "${torchrun_args[@]}" "$@"
fi

# One torchrun per replica group, each on its own GPUs; a SIGTERM reaches every group. To stop
# one group, signal its torchrun (printed below): SIGTERM lets it stop its ranks. torchrun
# starts each rank in a session of its own, so a SIGKILL of torchrun (or of its process
# group) leaves the ranks training; docs/reliability.md shows how to kill a group outright.
group_pids=()
for (( group = 0; group < ft_groups; group++ )); do
    [[ -n "${FT_GROUP:-}" && "$group" != "$FT_GROUP" ]] && continue
    if (( gpu_count > 0 )); then
        export CUDA_VISIBLE_DEVICES="$(seq -s, $(( group * group_ranks )) $(( (group + 1) * group_ranks - 1 )))"
    fi
    torchrun "${torchrun_args[@]}" "$@" "${ft_flags[@]}" --fault_tolerance.replica_id "$group" &
    group_pids+=($!)
    echo "run_train.sh: replica group $group: torchrun pid $! (stop this group alone with kill -TERM $!)"
done
trap 'kill -TERM "${group_pids[@]}" 2>/dev/null || true' TERM INT
status=0
for pid in "${group_pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done  # a trapped signal ends a wait early
    wait "$pid" || status=$?
done
exit "$status"
