#!/usr/bin/env bash
# The measurements still owed to the open issues, as named parts of device calls (each fits one call of
# the device tool's 600 s): `scripts/device_plan.sh PART...` on the GPU box, from the repo root, writes
# JSON and logs under $OUT (default ./device_out); every number it prints goes to docs/perf.md with date,
# device and command.
#
#   tests   issues 26/28: compiled tests not yet run on the GPU (TESTS_K: others): interleaved
#           gate/up, chained tiles (experts, fp8 linears), the selection test split one shape a case
#   moe     issue 26: the dispatch's fp8 expert tilings at 8192x256 and 8192x16 (MOE_CASES), bf16 beside,
#           unfenced (`_nf`) and unscaled (`_u`) probes; MOE_TILINGS: other names
#   sass    issue 26: each fp8 tiling of SASS_TILINGS at 8192x16 (bf16 beside) timed with its kernels' cubins and
#           ptxas reports kept under $OUT/cubins (sass_summary.py --extract; disassemble them where nvdisasm is)
#   k2      issue 26: Tiling.step_blocks 2 (`_k2s3`: three stages, `_k2`: two)
#           beside the interleaved gate_up and clustered down defaults, the unscaled probe and bf16 at 8192x16
#           and 8192x256 (MOE_CASES) and 64x256; their compiled tests (~3 min); K2_SASS=1: cubins
#   k2_default  issue 26: fp8_step_blocks 2 as the default: the linears' compiled test, the fp8 prefill beside HF
#           and a 256-expert decode step (batch 32 x 2048), each against fp8_step_blocks=1
#   wide    issue 26: 192-column fp8 tiles (scale_slices) against 128: their compiled tests, the expert calls over
#           issue 26's grid with bf16 beside, the fp8 prefill beside HF without them (WIDE_SASS=1: ptxas)
#   three_wgs  issue 26: 192-row tiles in three compute warpgroups (gate_up interleaved, down) against the defaults
#           and bf16 at 8192x16 and 8192x256 (MOE_CASES), their compiled test first
#   three_wgs_e2e  issue 26: KernelPolicy.fp8_three_wgs through the model: its compiled tests and the fp8 prefill beside
#           HF at 16 experts against fp8_three_wgs=false (then, a call of its own: MOE_CASES=8192x16,32768x16,8192x64 three_wgs)
#   stagger  issue 26: Tiling.stagger_warpgroups (`_st`: compute warpgroups started in turn at a tile's first step)
#           against the defaults it would change, bf16 beside, at 8192x16 and 8192x256 (MOE_CASES); its compiled test
#   one_tile  issue 26: one tile a program (Tiling.programs 0, `_np`): its compiled tests, then against the persistent
#           walk for bf16 and the fp8 defaults at 8192x256 (MOE_CASES: 8192x16,8192x64 in a second call), then ncu
#           of the bf16 gate_up `_np` call at 8192x256 (the persistent bf16 call reads 24 GB from DRAM where its
#           weights are 12.9 GB); ONE_TILE_TESTS=0: no tests
#   one_tile_e2e  issue 26: KernelPolicy.moe_tile_program_rows (on) through the model: the bf16 prefill of a 3-layer
#           slice (4 layers of bf16 256 experts do not fit an H100) at 256 experts, HF beside
#   moe_decode  the same at 64 tokens x 256 experts (the decode tilings)
#   close26  issue 26's last owed numbers, on the H200: the whole decode call over 256 experts at 1/8/64 tokens
#           (DECODE_TOKENS) by the device's busy time, then the kernel grid (MOE_CASES) under the defaults (three
#           compute warpgroups from 1024 rows an expert; the two-warpgroup tilings beside) and bf16 persistent and
#           one program a tile (the default at 256 rows an expert: 65% of the matmul rate on the H100)
#   e2e     issue 26: fp8 prefill at 8192 (E2E_EXPERTS, default 16) under each candidate policy (E2E_POLICIES), in
#           E2E_ROUNDS (2) rounds of alternating order, HF transformers beside
#   e2e_profile  issue 26: profile of that prefill (16 experts, fp8) by scope, default kernels and two warpgroups
#           (PROFILE_POLICIES: space-separated --kernels values; fp8_moe_kernel=true is the default policy)
#   mla     issue 28: sparse MLA decode at 1..128 queries with the device's busy time (MLA_DECODE: query counts,
#           MLA_TILINGS: bench_kernels' decode variants; MLA_OPS=1: command buffers off, the time op by op)
#   ncu     issue 26: Nsight Compute counters of gate_up at 8192x16 (NCU_CASES): fp8 joint and interleaved,
#           bf16 beside (NCU_TILINGS: others)
#   ncu_source  issue 26: where gate_up's warps stall, instruction by instruction (ncu's source page, SASS) at
#           8192x16: the promoted fp8 tiling and its unscaled probe (NCU_TILINGS: others)
#   paged   issue 28: one-wave paged scores off/on, twice, at batch 1 x 8k and batch 8 x 2k
#   mesh    issue 34 (multi-GPU kinds only): EP/TP scaling of the fp8 256-expert slice, two-batch overlap off/on
#   cp8     issue 34: cp = all GPUs prefill at 8k/32k/128k against cp 1
#   pd      issue 34: PD page transfer paths; serving with prefill on half the GPUs vs colocated
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device_out}
[ -n "${PLAN_DRY_RUN:-}" ] || mkdir -p "$OUT"
# a part cut by an outer `timeout` can leave its profiler or benchmark holding the GPU: stop them first, but not
# this plan's callers (a command line that names a benchmark beside this script matches the pattern too)
stop_leftovers() {
  local callers=" $$ " p=$$ pid
  while p=$(ps -o ppid= -p "$p" | tr -d ' ') && [ -n "$p" ] && [ "$p" -gt 1 ]; do callers+="$p "; done
  pkill -9 -x ncu
  for pid in $(pgrep -f 'scripts/(ncu_kernel|bench_[a-z_]+|gpu_tests)[.]py|-m pytest'); do
    [[ $callers == *" $pid "* ]] || kill -9 "$pid"
  done
}
[ -n "${PLAN_DRY_RUN:-}" ] || stop_leftovers 2>/dev/null || true
export PYTHONPATH=.:scripts JAX_PLATFORMS=cuda
PY=${PYTHON:-python3}
GLM=(--model random:glm-5 --num-layers 4)

run() {   # run NAME CMD...: one step's output to $OUT/NAME.log, its time and status to the summary
  local name=$1; shift
  if [ -n "${PLAN_DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; return; fi   # the commands only (the CPU test)
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$OUT/summary.txt"
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  echo "== $name rc=$rc $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}

gpus() { echo "${PLAN_GPUS:-$(nvidia-smi -L | wc -l)}"; }

part_tests() {
  run gpu_tests "$PY" scripts/gpu_tests.py tests/test_moe_kernels.py tests/test_fp8_linear.py tests/test_kernels.py tests/test_sparse_mla.py \
    -k "${TESTS_K:-interleaved_gate_up_compiled or (fp8_kernel_compiled and True) or fp8_linear_compiled or select_topk_compiled}" \
    --per-test 120 --budget "${TESTS_BUDGET:-480}" --json "$OUT/gpu_tests.json"
}

part_moe() {
  # what issue 26 still owes at the kernel level, on the H200 (its device; the fourteenth session's table
  # is the H100's): the dispatch's tilings (interleaved gate_up, clustered down; decode: clustered gate_up,
  # clustered joint pairs) with bf16 beside, the old joint gate_up, each fp8 one unfenced (`_nf`) and the
  # interleaved one unscaled (`_u`: what promotion costs); rerun the baseline on whichever GPU comes
  local names=2wg_n128_s3,2wg_n256_s3,1wg_n128_rm,2wg_n256_c2_rm                              # bf16
  names+=,2wg_n128_g16_c2_il,2wg_n64_g16_joint,2wg_n128_g16_c2,2wg_n256_c2_il_rm,2wg_n256_c2_pairs_joint_rm
  names+=,2wg_n128_g16_c2_il_nf,2wg_n128_g16_c2_nf,2wg_n128_g16_c2_il_u
  run "moe_tilings${MOE_TAG:-}" ${MOE_TIMEOUT:+timeout -k 5 "$MOE_TIMEOUT"} \
    "$PY" scripts/bench_moe_tilings.py --cases "${MOE_CASES:-8192x256,8192x16}" --tilings "${MOE_TILINGS:-$names}" \
    --json "$OUT/moe_tilings${MOE_TAG:-}.json"
}

part_sass() {
  local name nv
  # Mosaic prints SASS only where it finds nvdisasm on the PATH (the image has one off it); where it does
  # not, the printed modules' cubins are kept for sass_summary --nvdisasm here
  nv=$(command -v nvdisasm || ls /usr/local/cuda*/bin/nvdisasm /opt/nvidia/*/bin/nvdisasm 2>/dev/null | head -n 1)
  for name in $(echo "${SASS_TILINGS:-2wg_n128_g16_c2,2wg_n128_g16_c2_u,2wg_n128_g16_c2_nf}" | tr , ' '); do
    PATH="${nv:+$(dirname "$nv"):}$PATH" MOSAIC_GPU_DUMP_TO="$OUT/sass/$name" MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTXAS=1 \
      run "sass_$name" "$PY" scripts/bench_moe_tilings.py --cases 8192x16 --tilings "2wg_n128_s3,$name" \
      --json "$OUT/sass_$name.json"
    [ -n "${PLAN_DRY_RUN:-}" ] || {   # the modules' dump (60 MB a run): the cubins, ptxas lines and SASS kept
      "$PY" scripts/sass_summary.py --extract "$OUT/sass_$name.log" --to "$OUT/cubins"
      find "$OUT/sass_$name.log" "$OUT/sass/$name" -type f -size +4M ! -name '*.sass' -delete 2>/dev/null; }
  done
}

part_k2() {   # issue 26: Tiling.step_blocks 2 (each block's product added while the next one's runs; `_k2s3` in
  # three stages, `_k2` two): their compiled tests and kernel calls (end to end: k2_default)
  TESTS_K="two_block_steps_compiled" TESTS_BUDGET=100 part_tests
  local il=2wg_n128_g16_c2_il dn=2wg_n128_g16_c2
  MOE_TAG=_k2 MOE_CASES=${MOE_CASES:-8192x16,8192x256} \
    MOE_TILINGS=2wg_n128_s3,$il,${il}_k2s3,${il}_u_k2s3,2wg_n256_s3,$dn,${dn}_k2 part_moe
  MOE_TAG=_k2_decode MOE_CASES=64x256 MOE_TILINGS=2wg_n256_c2_il_rm,2wg_n256_c2_il_rm_k2 part_moe
  [ -z "${K2_SASS:-}" ] || SASS_TILINGS=${il}_k2s3 part_sass
}

part_k2_default() {   # issue 26: two-block steps by default (gate_up, decode linears) against one block a step
  TESTS_K="linear_two_block_steps_compiled" TESTS_BUDGET=100 part_tests
  E2E_POLICIES="default;fp8_step_blocks=1" part_e2e
  run decode_k2 "$PY" scripts/bench_decode_step.py "${GLM[@]}" --num-experts 256 --fp8-weights --batch 32 --context 2048 \
    --steps 30 --kernels "default;fp8_step_blocks=1;default;fp8_step_blocks=1" --json "$OUT/decode_k2.json"
}

part_wide() {   # issue 26: each warpgroup one m64n192 product a K block, promoted in 64-column slices
  TESTS_K="wide_tiles_compiled" TESTS_BUDGET=100 part_tests
  # issue 26's grid: bf16 (gate_up, down), the fp8 defaults (interleaved gate_up in two-block steps, down
  # in wide chained tiles) and the 128-column down they replace
  MOE_TAG=_wide MOE_CASES=${MOE_CASES:-8192x16,32768x16,8192x64,8192x256} \
    MOE_TILINGS=${MOE_TILINGS:-2wg_n128_s3,2wg_n256_s3,2wg_n128_g16_c2_il_k2s3,2wg_n128_g16_c2,2wg_n192_g16_c2_ch,2wg_n192_g16_ch} \
    part_moe
  E2E_POLICIES="${E2E_POLICIES:-default;fp8_wide_tiles=false}" part_e2e
  [ -z "${WIDE_SASS:-}" ] || SASS_TILINGS=2wg_n192_g16_c2 part_sass
}

part_three_wgs() {   # issue 26: three compute warpgroups on 192-row tiles (one promotes while two multiply)
  TESTS_K="three_compute_warpgroups_compiled" TESTS_BUDGET=100 part_tests
  local g=3wg_n128_g16
  MOE_TAG=_three_wgs MOE_CASES=${MOE_CASES:-8192x16,8192x256} \
    MOE_TILINGS=${MOE_TILINGS:-2wg_n128_s3,2wg_n128_g16_c2_il_k2s3,${g}_c2_il,${g}_il,${g}_c2_il_ch,${g}_c2_il_u,2wg_n128_g16_c2_il_u_k2s3,2wg_n256_s3,2wg_n192_g16_c2_ch,${g}_c2,${g}_c2_ch} \
    part_moe
}

part_three_wgs_e2e() {   # issue 26: the three-warpgroup tilings end to end
  TESTS_K="three_wgs_compiled or three_compute_warpgroups_compiled" TESTS_BUDGET=120 part_tests
  E2E_POLICIES="${E2E_POLICIES:-default;fp8_three_wgs=false}" part_e2e
}

part_close26() {   # issue 26: fp8 / bf16 >= 1.6x per call and the decode call >= 60% of HBM, on its device
  local g=3wg_n128_g16
  # the decode call first: the target the H200 last missed
  XLA_PYTHON_CLIENT_MEM_FRACTION=.95 run moe_decode_device "$PY" scripts/bench_kernels.py --only moe_fp8 --moe-tokens "" \
    --moe-decode-tokens "${DECODE_TOKENS:-1,8,64}" --moe-fp8-variants fp8_kernel --moe-device-time \
    --json "$OUT/moe_fp8_decode_device.json"
  MOE_TAG=_close26 MOE_CASES=${MOE_CASES:-8192x16,32768x16,8192x64,8192x256} \
    MOE_TILINGS=${MOE_TILINGS:-2wg_n128_s3,2wg_n128_s3_np,2wg_n256_s3,2wg_n256_s3_np,${g}_c2_il,${g}_c2_ch,2wg_n128_g16_c2_il_k2s3,2wg_n192_g16_c2_ch} \
    part_moe
}

part_stagger() {   # issue 26: do compute warpgroups started apart keep the tensor cores busy through promotion?
  TESTS_K="staggered_warpgroups_compiled" TESTS_BUDGET=100 part_tests
  local g=3wg_n128_g16 k2=2wg_n128_g16_c2_il_k2s3 n names=2wg_n128_s3,2wg_n128_s3_np,2wg_n256_s3,2wg_n256_s3_np
  for n in ${g}_c2_il ${g}_c2_il_ch ${g}_c2_ch $k2 2wg_n192_g16_c2_ch; do names+=,$n,${n}_st; done
  MOE_TAG=_stagger MOE_CASES=${MOE_CASES:-8192x16,8192x256} MOE_TILINGS=${MOE_TILINGS:-$names} part_moe
}

part_one_tile() {   # issue 26: do an expert's row tiles share its weight reads when started in order?
  # ONE_TILE_TESTS=0 leaves the compiled tests out (the bench still gives each tiling's error against its group's first)
  [ "${ONE_TILE_TESTS:-1}" = 0 ] || TESTS_K="moe_tile_programs_compiled" TESTS_BUDGET=200 part_tests
  local il=2wg_n128_g16_c2_il_k2s3 n
  local names=2wg_n128_s3,2wg_n256_s3,$il,2wg_n192_g16_c2_ch,2wg_n192_g16_c2
  for n in 2wg_n128_s3 2wg_n256_s3 $il 2wg_n192_g16_c2; do names+=,${n}_np; done
  MOE_TAG=_one_tile MOE_CASES=${MOE_CASES:-8192x256} MOE_TILINGS=$names part_moe
  NCU_CASES=8192x256 NCU_TILINGS="${NCU_TILINGS:-2wg_n128_s3 2wg_n128_s3_np}" part_ncu
}

part_one_tile_e2e() {
  XLA_PYTHON_CLIENT_MEM_FRACTION=.95 E2E_LAYERS=${E2E_LAYERS:-3} E2E_FP8=0 E2E_EXPERTS=${E2E_EXPERTS:-256} \
    E2E_POLICIES="${E2E_POLICIES:-default;moe_tile_program_rows=0}" part_e2e
}

part_moe_decode() {   # the same names at the decode case (64 tokens over 256 experts: rows-first, chained)
  MOE_CASES=64x256 MOE_TAG=_decode part_moe
}

part_e2e() {   # two rounds, the policies' order reversed in the second (a change under ~3% needs both orders)
  # E2E_FP8=0: bf16 weights (fp8 by default); E2E_LAYERS: the slice's depth (4)
  local fp8=(--fp8-weights) name=e2e_fp8; [ "${E2E_FP8:-1}" = 1 ] || { fp8=(); name=e2e_bf16; }
  run e2e "$PY" scripts/bench_prefill_vs_hf.py --num-layers "${E2E_LAYERS:-4}" --experts "${E2E_EXPERTS:-16}" --prompt-lens 8192 "${fp8[@]}" \
    --policies "${E2E_POLICIES:-default;fp8_three_wgs=false}" --rounds "${E2E_ROUNDS:-2}" \
    --timeout 500 --json "$OUT/$name.json"
}

part_e2e_profile() {   # issue 26: where the fp8 16-expert prefill of 8192 goes, in three and in two warpgroups
  for policy in ${PROFILE_POLICIES:-fp8_moe_kernel=true fp8_three_wgs=false}; do
    run "profile_${policy//[=,]/_}" "$PY" scripts/profile_prefill.py "${GLM[@]}" --num-experts "${E2E_EXPERTS:-16}" \
      --fp8-weights --lengths 8192 --budget 8192 --kernels "$policy" --json "$OUT/profile_${policy//[=,]/_}.json"
  done
}

part_mla() {
  run mla "$PY" scripts/bench_kernels.py --only sparse_mla --mla-prefill "" --mla-decode "${MLA_DECODE:-1,8,32,64,128}" \
    --mla-decode-tilings "${MLA_TILINGS:-mgpu_rows:p:k}" --mla-device-time ${MLA_OPS:+--command-buffers-off} \
    --json "$OUT/mla_decode${MLA_OPS:+_ops}.json"
}

part_ncu() {
  # fp8 joint, fp8 interleaved, bf16, the interleaved one unscaled (NCU_TILINGS: a subset)
  for t in ${NCU_TILINGS:-2wg_n64_g16_joint 2wg_n128_g16_c2_il 2wg_n128_s3 2wg_n128_g16_c2_il_u}; do
    run "ncu_$t" "$PY" scripts/ncu_kernel.py --kernel mosaic --launch-skip 2 --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --json "$OUT/ncu_$t.json" -- \
      "$PY" scripts/bench_moe_tilings.py --cases "${NCU_CASES:-8192x16}" --tilings "$t"
  done
}

part_ncu_source() {
  for t in ${NCU_TILINGS:-2wg_n128_g16_c2 2wg_n128_g16_c2_u}; do
    run "ncu_source_$t" "$PY" scripts/ncu_kernel.py --kernel mosaic --launch-skip 2 --source "$OUT/ncu_source_$t.csv" \
      --json "$OUT/ncu_source_$t.json" -- "$PY" scripts/bench_moe_tilings.py --cases 8192x16 --tilings "$t"
  done
}

part_paged() {
  for shape in "--batch 1 --context 8192" "--batch 8 --context 2048"; do
    local tag; tag=$(echo "$shape" | tr -d ' -' | tr -s 'a-z' | cut -c1-20)
    run "paged_$tag" "$PY" scripts/bench_decode_step.py "${GLM[@]}" --num-experts 256 --fp8-weights $shape \
      --steps 30 --kernels "default;mgpu_paged_one_wave=true;default;mgpu_paged_one_wave=true" \
      --json "$OUT/paged_$tag.json"
  done
}

part_mesh() {
  local n; n=$(gpus)
  local meshes="ep=1;ep=2;tp=2"
  [ "$n" -ge 4 ] && meshes+=";ep=4;tp=4;ep=2,tp=2"
  [ "$n" -ge 8 ] && meshes+=";ep=8;ep=4,tp=2"
  run mesh "$PY" scripts/bench_mesh.py "${GLM[@]}" --num-experts 256 --fp8-weights --meshes "$meshes" \
    --tbo off on --prompt-len 8192 --batch 2 --decode-batch 64 --decode-context 2048 --decode-tokens 32 \
    --profile --deadline-s 520 --json "$OUT/mesh.json"
}

part_cp8() {
  local n; n=$(gpus)
  run cp "$PY" scripts/bench_cp.py "${GLM[@]}" --num-experts 16 --cp 1 "$n" --prompt-lens 8192 32768 131072 \
    --deadline-s 520 --json "$OUT/cp.json"
}

part_pd() {   # transfer paths, then serving: prefill on half the GPUs and decode on the rest vs colocated
  local n; n=$(gpus)
  run pd_transfer "$PY" scripts/pd_transfer_bench.py --pages 64 --json "$OUT/pd_transfer.json"
  local load=(--concurrency 4 16 --num-prompts 64 --input-len 2048 --output-len 128)
  run serve_colocated "$PY" scripts/bench_serving.py "${GLM[@]}" --num-experts 16 "${load[@]}" \
    --json "$OUT/serve_colocated.json"
  run serve_pd "$PY" scripts/bench_serving.py "${GLM[@]}" --num-experts 16 "${load[@]}" \
    --pd-prefill-devices $((n / 2)) --pd-decode-replicas $((n - n / 2)) --json "$OUT/serve_pd.json"
}

[ $# -gt 0 ] || { sed -n '2,/^set /{/^set /!p}' "$0"; exit 2; }
for part in "$@"; do
  declare -F "part_$part" > /dev/null || { echo "unknown part: $part" >&2; exit 2; }
  "part_$part"
done
[ -n "${PLAN_DRY_RUN:-}" ] || cat "$OUT/summary.txt"
