#!/usr/bin/env bash
# Validates every manifest in deploy/k8s/ against the Kubernetes API schemas, in strict mode
# (unknown fields are errors), with kubernetes-validate (PyPI, Apache-2.0; its schemas are
# bundled, nothing is fetched while validating).
#
# Why: there is no cluster in CI, and a typo'd field in a Job or a rule the API rejects would
# only show up at `kubectl apply` time. The versions checked are the minimum that
# deploy/k8s/indexed-job.yaml claims ("Needs Kubernetes >= X", read from the file so the two
# cannot drift apart) and the newest version the validator knows.
#
#   scripts/ci/test-k8s-manifests.sh        (a few seconds; the first run installs the validator)
#
# The validator is pip-installed, pinned, into a virtual environment under .cache/venv-k8s
# (git-ignored). Schemas are not everything the API server checks: the script also checks the
# Job's pod failure policy and settings against what deploy/README.md documents (see below).
# Exit codes: 0 every manifest valid; 1 a manifest is invalid; 77 SKIPPED: the
# validator cannot be installed here (no venv support or no package index; printed on a line
# starting with "SKIPPED:").
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"

validator_version=1.37.0
venv=.cache/venv-k8s
echo "== test-k8s-manifests: deploy/k8s/*.yaml against the Kubernetes schemas (kubernetes-validate $validator_version, strict)"
skip() { echo "SKIPPED: test-k8s-manifests: $*"; exit 77; }

if ! "$venv/bin/kubernetes-validate" --version 2>/dev/null | grep -qF "$validator_version"; then
  echo "test-k8s-manifests: installing kubernetes-validate==$validator_version into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv" >/dev/null 2>&1 || skip "python3 -m venv failed (is the venv module installed?)"
  log="$(mktemp)"
  if ! "$venv/bin/pip" install --quiet --disable-pip-version-check "kubernetes-validate==$validator_version" >"$log" 2>&1; then
    tail -n 5 "$log"
    rm -f "$log"
    rm -rf "$venv"
    skip "pip could not install kubernetes-validate==$validator_version (no package index reachable?)"
  fi
  rm -f "$log"
fi

min_version="$(sed -n 's/^# Needs Kubernetes >= \([0-9][0-9.]*\).*/\1/p' deploy/k8s/indexed-job.yaml | head -n1)"
[[ -n "$min_version" ]] || { echo "test-k8s-manifests: indexed-job.yaml no longer says 'Needs Kubernetes >= X'" >&2; exit 1; }
[[ "$min_version" == *.*.* ]] || min_version="$min_version.0"

manifests=(deploy/k8s/*.yaml)
failed=0
for version in "$min_version" "$validator_version"; do
  if out="$("$venv/bin/kubernetes-validate" --strict --kubernetes-version "$version" "${manifests[@]}" 2>&1)"; then
    echo "Kubernetes $version: ${#manifests[@]} files valid"
  else
    failed=1
    echo "Kubernetes $version: INVALID"
  fi
  printf '%s\n' "$out" | sed 's/^/  /'
done
# The schemas cannot see the rules the API server and stageb add on top. Checked here, in the
# Job as written: the pod failure policy maps stageb's exit codes as deploy/README.md says
# (2 -> FailJob, 75 -> Ignore, DisruptionTarget -> Ignore, first match wins), the API server's
# own rules for it (restartPolicy Never; exit code 0 never listed under operator In; the
# containerName exists), the grace period outlasts rank 0's default 90 s drain, and
# completions, parallelism and WORLD_SIZE agree.
if out="$("$venv/bin/python" - deploy/k8s/indexed-job.yaml <<'PY' 2>&1
import sys, yaml
job = yaml.safe_load(open(sys.argv[1]))
spec, pod = job["spec"], job["spec"]["template"]["spec"]
problems = []
def expect(cond, what):
    if not cond:
        problems.append(what)
containers = {c["name"]: c for c in pod["containers"]}
expect(pod.get("restartPolicy") == "Never", "podFailurePolicy needs restartPolicy: Never")
def decide(code=None, condition=None):
    for rule in spec["podFailurePolicy"]["rules"]:
        ec = rule.get("onExitCodes")
        if ec and code is not None:
            expect(ec.get("containerName", next(iter(containers))) in containers, f"unknown containerName {ec.get('containerName')}")
            if ec["operator"] == "In":
                expect(0 not in ec["values"], "exit code 0 listed under operator In (the API rejects it)")
            hit = code in ec["values"]
            if (ec["operator"] == "In") == hit:
                return rule["action"]
        for pc in rule.get("onPodConditions", []):
            if condition and pc["type"] == condition and pc.get("status", "True") == "True":
                return rule["action"]
    return "Count"
for code, want in [(2, "FailJob"), (75, "Ignore"), (1, "FailIndex"), (3, "Count"), (137, "Count")]:
    got = decide(code=code)
    expect(got == want, f"exit code {code}: {got}, expected {want}")
got = decide(condition="DisruptionTarget")
expect(got == "Ignore", f"DisruptionTarget: {got}, expected Ignore")
expect("backoffLimitPerIndex" in spec, "backoffLimitPerIndex missing")
expect(pod.get("terminationGracePeriodSeconds", 30) > 90, "terminationGracePeriodSeconds must exceed the 90 s drain")
env = {e["name"]: e.get("value") for e in containers["stageb"].get("env", [])}
expect(spec["completions"] == spec["parallelism"] == int(env.get("WORLD_SIZE", -1)),
       "completions, parallelism and WORLD_SIZE differ")
expect("--resume" in containers["stageb"].get("args", []), "a recreated index 0 must run with --resume")
for p in dict.fromkeys(problems):
    print(f"ERROR {sys.argv[1]}: {p}")
if problems:
    sys.exit(1)
print(f"INFO {sys.argv[1]}: exit 2 -> FailJob, 1 -> FailIndex, 75 -> Ignore, DisruptionTarget -> Ignore, 3/137 -> counted; grace {pod['terminationGracePeriodSeconds']} s; {spec['completions']} ranks")
PY
)"; then
  echo "pod failure policy and Job settings: as documented"
else
  failed=1
  echo "pod failure policy and Job settings: WRONG"
fi
printf '%s\n' "$out" | sed 's/^/  /'

if ((failed)); then
  echo "test-k8s-manifests: FAILED"
  exit 1
fi
echo "test-k8s-manifests: all manifests valid against Kubernetes $min_version and $validator_version (strict), Job policy as documented"
