//! Specs of the row types: each is written byte for byte as rank 0 always wrote it (the
//! expected lines are rows of the format as it stood before the types existed), and reads
//! back, damaged rows included.

use stageb_shared::domain::Verdict;

use super::*;

const MISSION: &str = "挡风板安装检查";

fn written<T: Serialize>(row: &T) -> String {
    serde_json::to_string(row).unwrap()
}

fn provenance() -> Provenance {
    Provenance {
        worker_id: "w1".into(),
        lease_id: 5,
        attempt: 1,
    }
}

/// The ticket QC-1::fail in epoch 2.
fn head() -> TicketHead {
    TicketHead {
        schema_version: 1,
        group_id: "QC-1".into(),
        mission: "m".into(),
        ticket_key: "QC-1::fail".into(),
        gt_label: Some(Verdict::Fail),
        epoch: 2,
    }
}

/// A failure row of `reason` for ticket QC-1::fail, epoch 2, before its candidate part.
fn failure(reason: &str) -> FailureRow {
    FailureRow {
        schema_version: 1,
        ticket_key: "QC-1::fail".into(),
        group_id: "QC-1".into(),
        mission: MISSION.into(),
        gt_label: Some(Verdict::Fail),
        epoch: 2,
        global_step: 7,
        epoch_step: 3,
        guidance_step: 4,
        guidance_hash: "sha256:ab".into(),
        reason: reason.into(),
        ..FailureRow::default()
    }
}

#[test]
fn a_format_error_row_names_its_candidate_and_nulls_the_error() {
    let row = FailureRow {
        candidate_index: Some(3),
        decode_index: Some(1),
        violation: Some(ViolationRecord {
            code: "E_NO_VERDICT".into(),
            detail: "no Verdict line".into(),
        }),
        raw_text: Some("Verdict 通过".into()),
        ..failure(failure_reason::FORMAT_ERROR)
    };
    assert_eq!(
        written(&row),
        r#"{"schema_version":1,"ticket_key":"QC-1::fail","group_id":"QC-1","mission":"挡风板安装检查","gt_label":"fail","epoch":2,"global_step":7,"epoch_step":3,"guidance_step":4,"guidance_hash":"sha256:ab","reason":"format_error","candidate_index":3,"decode_index":1,"violation":{"code":"E_NO_VERDICT","detail":"no Verdict line"},"raw_text":"Verdict 通过","error":null}"#
    );
}

#[test]
fn a_hard_failure_row_nulls_the_candidate_and_carries_the_job_error() {
    let row = FailureRow {
        error: Some(JobFailure {
            code: "PROMPT_TOO_LONG".into(),
            message: "too long".into(),
        }),
        ..failure(failure_reason::ENGINE_ERROR)
    };
    assert_eq!(
        written(&row),
        r#"{"schema_version":1,"ticket_key":"QC-1::fail","group_id":"QC-1","mission":"挡风板安装检查","gt_label":"fail","epoch":2,"global_step":7,"epoch_step":3,"guidance_step":4,"guidance_hash":"sha256:ab","reason":"engine_error","candidate_index":null,"decode_index":null,"violation":null,"raw_text":null,"error":{"code":"PROMPT_TOO_LONG","message":"too long"}}"#
    );
}

#[test]
fn a_trajectory_row_writes_sampling_knobs_as_their_f64_widening() {
    let row = TrajectoryRow {
        ticket: head(),
        global_step: 7,
        guidance_step: 4,
        reflection_cycle: 1,
        result: CandidateResult {
            candidate_index: 3,
            decode_index: 1,
            sample_index: 1,
            decode: DecodeRecord {
                temperature: f64::from(0.7f32),
                top_p: f64::from(0.9f32),
                max_new_tokens: 32,
                repetition_penalty: f64::from(1.05f32),
                seed: u64::MAX,
            },
            text: "Verdict 通过".into(),
            violation: Some(ViolationRecord {
                code: "E_NO_VERDICT".into(),
                detail: "no Verdict line".into(),
            }),
            finish_reason: "length".into(),
            completion_tokens: 32,
            needs_manual_review: true,
            ..CandidateResult::default()
        },
        runtime: RowRuntime::default(),
    };
    assert_eq!(
        written(&row),
        r#"{"schema_version":1,"group_id":"QC-1","mission":"m","ticket_key":"QC-1::fail","gt_label":"fail","epoch":2,"global_step":7,"guidance_step":4,"reflection_cycle":1,"result":{"candidate_index":3,"decode_index":1,"sample_index":1,"decode":{"temperature":0.699999988079071,"top_p":0.8999999761581421,"max_new_tokens":32,"repetition_penalty":1.0499999523162842,"seed":18446744073709551615},"text":"Verdict 通过","verdict":null,"reason":"","format_ok":false,"violation":{"code":"E_NO_VERDICT","detail":"no Verdict line"},"finish_reason":"length","completion_tokens":32,"label_match":null,"vote_strength":null,"low_agreement":false,"needs_manual_review":true},"runtime":{}}"#
    );
}

#[test]
fn a_selection_row_puts_the_audit_fields_after_the_decision() {
    let row = SelectionRow {
        ticket: head(),
        epoch_step: 3,
        global_step: 7,
        schedule_step: 1,
        result: SelectionResult {
            selection: Selection {
                verdict: Some(Verdict::Pass),
                reason: "好".into(),
                vote_strength: Some(0.5),
                selected_candidate: Some(0),
                rule_hit: "Selection.Majority".into(),
                ..Selection::default()
            },
            guidance_step: 4,
            reflection_change: Some("r-1".into()),
            reflection_cycle: 1,
            eligible: true,
            ineligible_reason: None,
        },
        eligibility: Eligibility {
            eligible: true,
            rule_hit: "Eligible.LabelMismatch".into(),
            reflection_priority: 1,
            ..Eligibility::default()
        },
        guidance_hash: "sha256:ab".into(),
        split: None,
        runtime: RowRuntime {
            provenance: Some(provenance()),
            rollout: None,
        },
    };
    let line = written(&row);
    assert_eq!(
        line,
        r#"{"schema_version":1,"group_id":"QC-1","mission":"m","ticket_key":"QC-1::fail","gt_label":"fail","epoch":2,"epoch_step":3,"global_step":7,"schedule_step":1,"result":{"verdict":"pass","reason":"好","vote_strength":0.5,"label_match":false,"selected_candidate":0,"warnings":[],"conflict_flag":false,"needs_manual_review":false,"manual_review_recommended":false,"low_agreement":false,"rollout_contradiction":false,"vote_counts":{"pass":0,"fail":0,"malformed":0},"vote_verdict":null,"fail_first_hits":[],"rule_hit":"Selection.Majority","explanation":"","inputs_digest":"","guidance_step":4,"reflection_change":"r-1","reflection_cycle":1,"eligible":true,"ineligible_reason":null},"eligibility":{"eligible":true,"reasons":[],"rule_hit":"Eligible.LabelMismatch","explanation":"","reflection_priority":1},"guidance_hash":"sha256:ab","runtime":{"worker_id":"w1","lease_id":5,"attempt":1}}"#
    );
    assert_eq!(serde_json::from_str::<SelectionRow>(&line).unwrap(), row);
    let held_out = SelectionRow {
        split: Some(Split::Final),
        ..row
    };
    let line = written(&held_out);
    assert!(
        line.contains(r#""guidance_hash":"sha256:ab","split":"final","runtime":"#),
        "{line}"
    );
    assert_eq!(
        serde_json::from_str::<SelectionRow>(&line).unwrap(),
        held_out
    );
}

#[test]
fn a_rollout_runtime_is_its_provenance_then_its_timing() {
    let runtime = RowRuntime {
        provenance: Some(provenance()),
        rollout: Some(RolloutTiming {
            prompt_tokens: 904,
            prefix_tokens: 0,
            prefill_us: 1127967,
            decode_us: 516231,
        }),
    };
    let line = written(&runtime);
    assert_eq!(
        line,
        r#"{"worker_id":"w1","lease_id":5,"attempt":1,"prompt_tokens":904,"prefix_tokens":0,"prefill_us":1127967,"decode_us":516231}"#
    );
    assert_eq!(serde_json::from_str::<RowRuntime>(&line).unwrap(), runtime);
    assert_eq!(
        serde_json::from_str::<RowRuntime>("{}").unwrap(),
        RowRuntime::default()
    );
}

#[test]
fn a_row_missing_keys_reads_as_their_defaults() {
    let row: FailureRow = serde_json::from_str(
        r#"{"schema_version":1,"epoch":1,"reason":"format_error","violation":{"code":"X"}}"#,
    )
    .unwrap();
    assert_eq!(row.epoch, 1);
    assert_eq!(row.ticket_key, "");
    assert_eq!(row.gt_label, None);
    assert_eq!(row.violation.unwrap().code, "X");
    let selection: SelectionRow =
        serde_json::from_str(r#"{"epoch":2,"result":{"label_match":true}}"#).unwrap();
    assert!(selection.result.selection.label_match);
    assert_eq!(selection.ticket.epoch, 2);
    assert_eq!(selection.result.selection.vote_strength, None);
}
