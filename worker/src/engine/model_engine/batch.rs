//! Continuous batching on both backends: many jobs (rollouts and generations) in one
//! decode loop. Jobs join with [`ModelEngine::admit_job`]; every [`ModelEngine::step_batch`]
//! runs one forward call that holds a chunk of at most one joining job's prompt (so a long
//! prompt never stalls running rows for more than one chunk) and the next token of every live
//! row of every running job; a job leaves, with its output, the step its last row ends.
//!
//! A row's tokens never depend on what shares its steps: its logits come from its own prompt
//! and tokens ([`CpuModel::forward_parts`] keeps every position's arithmetic what it is alone;
//! on the candle backend `Transformer::forward_decode` runs every projection on fixed tiles of
//! rows and a prefill chunk in a forward call of its own; its paged step,
//! `Transformer::forward_decode_paged`, keeps the tiles and reduces each row's attention in an
//! order fixed by the row's own length),
//! its draw is `uniform_at(seed, token index)`, and the prompt's prefill follows the fixed
//! chunk schedule whatever step it runs in. `tests/engine_batching.rs` checks it on the real
//! model. Also here: building a job's rows from its request and its output from its rows,
//! which the one-job path ([`Engine::rollout`], [`Engine::generate`]) shares.

use std::time::Instant;

use super::draft;
use super::rows::{Feeding, Row};
use super::{MIN_CONSTRAINED_NEW_TOKENS, ModelEngine, check_params, chunk_end};
use crate::constraint::ConstraintSpec;
use crate::engine::backend::{Input, JobKv, Reuse, StepOut};
use crate::engine::cpu::model::Slot;
use crate::engine::sampler::SeenTokens;

use crate::engine::{
    BatchShare, CancelFlag, CandidateOutput, DecodeRequest, EngineError, FinishReason,
    GenerateOutput, GenerateRequest, Job, JobOutput, JobProgress, RolloutOutput,
};
use rayon::prelude::*;

/// A job in the running batch.
pub(super) struct Live {
    key: u64,
    /// `Some((decode_index, sample_index))` per row for a rollout; `None` for a generation.
    ids: Option<RowIds>,
    prompt: Vec<u32>,
    pub(super) rows: Vec<Row>,
    /// Its KV, the backend's own.
    pub(super) kv: JobKv,
    /// The prompt's last logits: every row's first draw.
    first: Vec<f32>,
    /// Where each row's logits for its next token are: `None`, in `first`; `Some(k)`, row `k`
    /// of the engine's step logits ([`StepLogits`](super::readback::StepLogits)), followed by
    /// one more row per draft token it was fed ([`Row::drafts`]).
    pub(super) at: Vec<Option<usize>>,
    /// Prompt positions in the cache.
    prefilled: usize,
    /// Leading positions shared from the prefix store.
    pub(super) reused: usize,
    /// The prefix store the job's prompt comes from and goes to.
    keep: Reuse,
    /// The store was looked up (or need not be): a job looks its prompt up when its prefill
    /// starts, not when it joins, so it finds prompts that jobs before it just prefilled.
    looked_up: bool,
    /// The prompt went to the store when its prefill ended: nothing to keep when the job
    /// ends.
    published: bool,
    cancel: CancelFlag,
    admitted: Instant,
    pub(super) prefill_us: u64,
    decode_from: Option<Instant>,
    batch: BatchShare,
    /// Tokens its rows took by forced-token fast-forward.
    pub(super) forced: u64,
    /// Draft tokens its rows were fed, and took.
    drafts: (u64, u64),
    /// Forward calls that fed its rows.
    decode_calls: u64,
}

impl Live {
    fn decoding(&self) -> bool {
        self.prefilled == self.prompt.len()
    }

    /// Microseconds since its rows began decoding (0 before).
    pub(super) fn decode_us(&self) -> u64 {
        self.decode_from
            .map_or(0, |t| t.elapsed().as_micros() as u64)
    }
}

/// What one forward call takes: the next prefill chunk of the earliest job still prefilling
/// (the fixed schedule, [`chunk_end`]), and every fed row's
/// tokens (a row's forced run in order, then its drafts), job by job; a row's logits are
/// wanted after its last token before its drafts and after each draft.
fn gather(live: &[Live], feeds: &[Vec<Vec<u32>>], may_prefill: bool) -> Vec<Input> {
    let filling = live
        .iter()
        .position(|j| !j.decoding())
        .filter(|_| may_prefill);
    let mut inputs = Vec::new();
    for (ji, (j, f)) in live.iter().zip(feeds).enumerate() {
        if Some(ji) == filling {
            let end = chunk_end(j.prefilled, j.prompt.len());
            inputs.push(Input::chunk(ji, j.prompt[j.prefilled..end].to_vec()));
        } else if f.iter().any(|r| !r.is_empty()) {
            let mut input = Input {
                job: ji,
                tokens: Vec::new(),
                slots: Vec::new(),
                logits_at: Vec::new(),
                rows: Some(Vec::new()),
            };
            for (r, feed) in f.iter().enumerate().filter(|(_, f)| !f.is_empty()) {
                input.tokens.extend_from_slice(feed);
                input
                    .slots
                    .extend(std::iter::repeat_n(Slot::Row(r), feed.len()));
                let drafts = j.rows[r].drafts.len();
                let end = input.tokens.len();
                input.logits_at.extend(end - 1 - drafts..end);
                let rows = input.rows.get_or_insert_default();
                rows.extend(std::iter::repeat_n(r, drafts + 1));
            }
            inputs.push(input);
        }
    }
    inputs
}

/// A job's rows' feeds for the next forward call, and the draft tokens fed last step and taken.
type JobFeeds = (Vec<Vec<u32>>, (u64, u64));

/// Each row's `(decode_index, sample_index)` in a rollout.
pub(super) type RowIds = Vec<(u32, u32)>;

/// A finished job: its key and its output or error.
pub type Finished = (u64, Result<JobOutput, EngineError>);

impl ModelEngine {
    /// Whether this engine runs jobs in one continuous batch ([`Self::admit_job`]): both
    /// backends do (the CPU fast path over per-row caches, the candle backend over one
    /// lockstep cache per job, `forward_decode` taking every job's rows in one step).
    pub fn batches(&self) -> bool {
        true
    }

    /// Jobs in the running batch.
    pub fn jobs_in_batch(&self) -> usize {
        self.live.len()
    }

    /// How far the job of `key` in the running batch has got ([`Engine::job_progress`](crate::engine::Engine::job_progress)).
    pub fn job_progress(&self, key: u64) -> Option<JobProgress> {
        let j = self.live.iter().find(|j| j.key == key)?;
        Some(JobProgress {
            prompt_done: j.prefilled as u32,
            tokens: j.rows.iter().map(|r| r.tokens.len() as u64).sum(),
            rows: j.rows.len() as u32,
            rows_finished: j.rows.iter().filter(|r| r.finish.is_some()).count() as u32,
        })
    }

    /// Bytes of KV cache `prompt_len` prompt tokens and `rows` rows of `max_new` tokens take
    /// (keys and values of every layer in the cache's dtype): what a job holds at its peak.
    /// On both backends the rows share the prompt's positions and hold their own after it.
    pub fn kv_bytes(&self, prompt_len: usize, rows: usize, max_new: usize) -> u64 {
        let per_position = self.backend.kv_bytes_per_position();
        per_position * (prompt_len + rows * max_new) as u64
    }

    /// Adds `job` to the running batch under `key`; it starts at the next step. A job that
    /// cannot run (bad request, prompt too long) is refused here, before it holds memory.
    pub fn admit_job(
        &mut self,
        key: u64,
        job: &Job,
        cancel: CancelFlag,
    ) -> Result<(), EngineError> {
        let (messages, rows, ids, keep) = match job {
            Job::Rollout(r) => {
                let (rows, ids) = self.rollout_rows(&r.decodes, r.constrained)?;
                (&r.messages, rows, Some(ids), Reuse::Rollouts)
            }
            Job::Generate(g) => (
                &g.messages,
                vec![self.generate_row(g)?],
                None,
                Reuse::Generations,
            ),
        };
        let prompt = self.prompt_ids(messages)?;
        self.admit_prompt(key, prompt, (rows, ids), keep, cancel)
    }

    /// Diagnostics (`stageb probe rollout --jobs`): admits a rollout of `prompt`, token ids
    /// used as they are (as [`Self::rollout_ids`]), under `key`.
    #[doc(hidden)]
    pub fn admit_ids(
        &mut self,
        key: u64,
        prompt: &[u32],
        decodes: &[DecodeRequest],
        constrained: bool,
    ) -> Result<(), EngineError> {
        let (rows, ids) = self.rollout_rows(decodes, constrained)?;
        let rows = (rows, Some(ids));
        self.admit_prompt(
            key,
            prompt.to_vec(),
            rows,
            Reuse::Rollouts,
            CancelFlag::default(),
        )
    }

    /// A job of `prompt` and its rows (with their ids for a rollout) joins the batch.
    fn admit_prompt(
        &mut self,
        key: u64,
        prompt: Vec<u32>,
        (rows, ids): (Vec<Row>, Option<RowIds>),
        keep: Reuse,
        cancel: CancelFlag,
    ) -> Result<(), EngineError> {
        let max_new = rows.iter().map(|r| r.max_new).max().unwrap_or(0);
        self.check_fits(&prompt, max_new)?;
        let kv = self.backend.new_job(prompt.len())?;
        let n = rows.len();
        self.live.push(Live {
            key,
            ids,
            prompt,
            rows,
            kv,
            first: Vec::new(),
            at: vec![None; n],
            prefilled: 0,
            reused: 0,
            keep,
            looked_up: false,
            published: false,
            cancel,
            admitted: Instant::now(),
            prefill_us: 0,
            decode_from: None,
            batch: BatchShare::default(),
            forced: 0,
            drafts: (0, 0),
            decode_calls: 0,
        });
        Ok(())
    }

    /// Runs the one job of `prompt` and `rows` to its end in a batch of its own (the running
    /// batch must be set aside by the caller), cancelled by the engine's flag. Returns the
    /// ended job, its prompt kept in its store.
    pub(super) fn run_alone(
        &mut self,
        prompt: Vec<u32>,
        rows: (Vec<Row>, Option<RowIds>),
        keep: Reuse,
    ) -> Result<Live, EngineError> {
        let cancel = self.cancel.clone();
        self.admit_prompt(0, prompt, rows, keep, cancel)?;
        loop {
            let (ended, mut failed) = self.step_jobs();
            if let Some((_, e)) = failed.pop() {
                return Err(e);
            }
            if let Some(job) = ended.into_iter().next() {
                self.retire(&job);
                return Ok(job);
            }
        }
    }

    /// The job whose prefill runs next (the earliest still prefilling) starts after the
    /// longest prefix its store holds, if it has not looked yet: the store may hold prompts
    /// that jobs of the same wave prefilled meanwhile ([`Self::publish_prompt`]). Where the
    /// prefill starts changes no bit (the prefix store's contract; on the candle backend only
    /// whole chunks are reused).
    fn look_up_prefix(&mut self, live: &mut [Live]) -> Result<(), EngineError> {
        let Some(j) = live.iter_mut().find(|j| !j.decoding()) else {
            return Ok(());
        };
        if std::mem::replace(&mut j.looked_up, true) || j.prefilled > 0 {
            return Ok(());
        }
        let reused = self.backend.look_up(j.keep, &j.prompt, &mut j.kv)?;
        (j.prefilled, j.reused) = (reused, reused);
        Ok(())
    }

    /// A job whose prompt was just prefilled hands it to its store at once: jobs that start
    /// their prefill after this one reuse it instead of computing it again. On the CPU path
    /// the store gets the same blocks (the job keeps reading them, shared, not copied); on the
    /// candle backend a copy of the prompt's whole chunks. Nothing to keep when the job ends.
    fn publish_prompt(&mut self, job: &mut Live) {
        job.published = self.backend.publish(job.keep, &job.prompt, &job.kv);
    }

    /// One step of the running batch: jobs whose flag was raised leave cancelled; every live
    /// row samples its next token; one forward call takes those tokens and the next prefill
    /// chunk of the earliest joining job. Returns the jobs that ended.
    pub fn step_batch(&mut self) -> Vec<Finished> {
        self.run_pooled(|eng| eng.step_inner())
    }

    fn step_inner(&mut self) -> Vec<Finished> {
        let (ended, failed) = self.step_jobs();
        let mut done: Vec<Finished> = failed.into_iter().map(|(k, e)| (k, Err(e))).collect();
        for j in ended {
            done.push((j.key, self.finish_job(j)));
        }
        done
    }

    /// [`Self::step_inner`] before the ended jobs' outputs are made: the jobs whose rows all
    /// ended, and the jobs that failed (or were cancelled) with their errors.
    fn step_jobs(&mut self) -> (Vec<Live>, Vec<(u64, EngineError)>) {
        let mut done = Vec::new();
        let mut ended = Vec::new();
        let mut live = std::mem::take(&mut self.live);
        live.retain(|j| {
            let gone = j.cancel.is_cancelled();
            if gone {
                done.push((j.key, EngineError::Cancelled));
            }
            !gone
        });
        // Sample every decoding row of every job at once (on a GPU the host's cores, while
        // the device waits for the next step's tokens); a job whose rows all ended leaves.
        let this = &*self;
        let t = Instant::now();
        let feeding = self.feeding(&live);
        let sampled: Vec<Result<JobFeeds, EngineError>> = live
            .par_iter_mut()
            .map(|j| this.sample_job(j, feeding))
            .collect();
        self.split.sampling += t.elapsed();
        let mut feeds: Vec<Vec<Vec<u32>>> = Vec::with_capacity(live.len());
        let mut keep_live = Vec::with_capacity(live.len());
        for (mut j, sampled) in live.into_iter().zip(sampled) {
            match sampled {
                Ok((f, _)) if j.decoding() && f.iter().all(|r| r.is_empty()) => ended.push(j),
                Ok((f, (fed, taken))) => {
                    self.split.drafts_fed += fed;
                    self.split.drafts_taken += taken;
                    j.drafts = (j.drafts.0 + fed, j.drafts.1 + taken);
                    feeds.push(f);
                    keep_live.push(j);
                }
                Err(e) => done.push((j.key, e)),
            }
        }
        let mut live = keep_live;
        let stepped = self
            .look_up_prefix(&mut live)
            .and_then(|()| self.forward_batch(&mut live, &feeds));
        if let Err(e) = stepped {
            // A failed forward leaves caches half-written: every job in it fails (the first
            // with the error itself).
            let msg = e.to_string();
            let mut first = Some(e);
            done.extend(live.drain(..).map(|j| {
                let e = first.take();
                (j.key, e.unwrap_or_else(|| EngineError::Model(msg.clone())))
            }));
        }
        self.live = live;
        (ended, done)
    }

    /// The next tokens of `job`'s live rows (forced runs and drafts included), or nothing
    /// while it is still prefilling; its rows' positions of drafts not taken are forgotten.
    fn sample_job(&self, job: &mut Live, feeding: Feeding) -> Result<JobFeeds, EngineError> {
        if !job.decoding() {
            return Ok((vec![Vec::new(); job.rows.len()], (0, 0)));
        }
        job.decode_from.get_or_insert_with(Instant::now);
        // Each live row's slice of the logits (a finished row reads none).
        let logits: Vec<&[f32]> = job
            .rows
            .iter()
            .zip(&job.at)
            .map(|(row, at)| match (row.finish, at) {
                (Some(_), _) => &[][..],
                (None, None) => job.first.as_slice(),
                (None, Some(k)) => self.step_logits.rows(*k, 1 + row.drafts.len()),
            })
            .collect();
        let steps = self.sample_rows_of(&mut job.rows, &logits, &job.prompt, feeding)?;
        let (mut feeds, mut fed, mut taken) = (Vec::with_capacity(steps.len()), 0, 0);
        for (r, step) in steps.into_iter().enumerate() {
            if step.rewind > 0 {
                self.backend.rewind_row(&mut job.kv, r, step.rewind)?;
            }
            job.forced += step.forced;
            (fed, taken) = (fed + step.drafts_fed, taken + step.taken);
            feeds.push(step.feed);
        }
        Ok((feeds, (fed, taken)))
    }

    /// How the rows of `live` are fed this step: forced runs and draft tokens in one
    /// multi-token forward need per-row positions, the CPU path's alone; drafts go to steps of
    /// few rows ([`draft::per_row`]).
    fn feeding(&self, live: &[Live]) -> Feeding {
        let multi = self.backend.multi_token_rows();
        let rows = live
            .iter()
            .filter(|j| j.decoding())
            .flat_map(|j| &j.rows)
            .filter(|r| r.finish.is_none())
            .count();
        Feeding {
            fast_forward: self.fast_forward && multi,
            drafts: if self.draft && multi {
                draft::per_row(rows)
            } else {
                0
            },
        }
    }

    /// One forward call: the rows' tokens in `feeds` (one entry per job of `live`) and one
    /// prefill chunk of the earliest job still prefilling; then each fed row's logits, and a
    /// job whose prompt is complete gets its rows.
    fn forward_batch(
        &mut self,
        live: &mut [Live],
        feeds: &[Vec<Vec<u32>>],
    ) -> Result<(), EngineError> {
        let inputs = gather(live, feeds, self.may_prefill(live));
        self.last_step = (inputs.iter().map(|i| i.tokens.len()).sum(), inputs.len());
        // Rows fed (a row fed drafts counts once) and prefill chunks.
        let rows: usize = inputs
            .iter()
            .map(|i| match &i.rows {
                Some(r) => 1 + r.windows(2).filter(|w| w[0] != w[1]).count(),
                None => 1,
            })
            .sum();
        for i in &inputs {
            live[i.job].batch.add_step(rows);
        }
        if inputs.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        // The prefill chunk's logits come back; the decoded rows' land in the step logits,
        // input by input, row by row.
        let jobs = live.iter_mut().map(|j| &mut j.kv).collect();
        let out = StepOut {
            logits: &mut self.step_logits,
            split: &mut self.split,
        };
        let mut chunk_logits = self.backend.forward(jobs, &inputs, out)?;
        let t1 = Instant::now();
        let mut k = 0;
        for i in &inputs {
            let j = &mut live[i.job];
            match &i.rows {
                None => {
                    j.prefilled += i.tokens.len();
                    j.prefill_us += (t1 - t0).as_micros() as u64;
                    if j.decoding() {
                        self.backend.prompt_prefilled(&mut j.kv)?;
                        self.publish_prompt(j);
                        self.start_rows(j, chunk_logits.take().unwrap_or_default())?;
                    }
                }
                Some(rows) => {
                    j.decode_calls += 1;
                    // A row's logits are consecutive: it reads from its first.
                    let mut last = None;
                    for &r in rows {
                        if last != Some(r) {
                            j.at[r] = Some(k);
                        }
                        (last, k) = (Some(r), k + 1);
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether the earliest job still prefilling may run its next chunk (CPU path): always
    /// once its prefill has begun, or when no other job has; else only while the worst cases
    /// of the jobs begun and its own (prompt blocks and every row at `max_new`, in whole
    /// blocks) fit the worker's KV budget. So the pool never holds more than the budget and the
    /// stores' (the worker's own bound, `job_kv_bound`, keeps it too): a job that does not fit
    /// waits for others to end, and none fails or is evicted. The step a prefill runs in
    /// changes no bit.
    fn may_prefill(&self, live: &[Live]) -> bool {
        let Some(blocks) = self.backend.blocks() else {
            return true;
        };
        let (b, block_bytes, per_row) = (blocks.positions, blocks.bytes, blocks.per_row);
        let begun = |j: &Live| j.decoding() || j.prefilled > j.reused;
        let Some(next) = live.iter().position(|j| !j.decoding()) else {
            return true;
        };
        if begun(&live[next]) {
            return true;
        }
        let need = |j: &Live| {
            let max_new = j.rows.iter().map(|r| r.max_new).max().unwrap_or(0);
            (j.prompt.len().div_ceil(b) + j.rows.len() * (max_new.div_ceil(b) + per_row)) as u64
        };
        let held: Vec<u64> = live.iter().filter(|j| begun(j)).map(need).collect();
        if held.is_empty() {
            return true;
        }
        let blocks = self.kv_budget / block_bytes.max(1) as u64;
        held.iter().sum::<u64>() + need(&live[next]) <= blocks
    }

    /// A job whose prompt is prefilled: every row starts from the prompt's last logits, with
    /// room for its tokens and (with a repetition penalty) the prompt's tokens seen.
    fn start_rows(&mut self, job: &mut Live, first: Vec<f32>) -> Result<(), EngineError> {
        let max_new = job.rows.iter().map(|r| r.max_new).max().unwrap_or(0);
        let vocab = self.backend.config().vocab_size;
        if job.rows.iter().any(|r| r.params.repetition_penalty != 1.0) {
            let mut seen = SeenTokens::new(vocab);
            for &t in &job.prompt {
                seen.insert(t);
            }
            for r in job.rows.iter_mut() {
                if r.params.repetition_penalty != 1.0 {
                    r.seen = Some(seen.clone());
                }
            }
        }
        let (n, prompt_len) = (job.rows.len(), job.prompt.len());
        self.backend.add_rows(&mut job.kv, n, max_new, prompt_len)?;
        job.first = first;
        job.at = vec![None; n];
        Ok(())
    }

    /// The output of a job whose rows all ended; its prompt goes to its prefix store.
    fn finish_job(&mut self, job: Live) -> Result<JobOutput, EngineError> {
        let decode_us = job.decode_us();
        let out = match &job.ids {
            Some(ids) => JobOutput::Rollout(self.rollout_output(
                &job.rows,
                ids,
                job.prompt.len(),
                job.reused,
                job.prefill_us,
                decode_us,
            )?),
            None => JobOutput::Generate(self.generate_output(
                &job.rows[0],
                job.prompt.len(),
                job.reused,
                job.admitted.elapsed().as_micros() as u64,
            )?),
        };
        let out = out.with_batch(job.batch);
        self.retire(&job);
        Ok(out)
    }

    /// An ended job (alone or batched): its counts logged at debug level; its prompt goes to its
    /// prefix store, unless it went when its prefill ended.
    fn retire(&mut self, job: &Live) {
        tracing::debug!(
            key = job.key,
            rows = job.rows.len(),
            tokens = job.rows.iter().map(|r| r.tokens.len()).sum::<usize>(),
            decode_calls = job.decode_calls,
            forced = job.forced,
            drafts_fed = job.drafts.0,
            drafts_taken = job.drafts.1,
            "job decoded"
        );
        if !job.published {
            self.backend.publish(job.keep, &job.prompt, &job.kv);
        }
    }

    /// A prompt of `prompt` tokens with `max_new` to generate must fit the context.
    pub(super) fn check_fits(&self, prompt: &[u32], max_new: usize) -> Result<(), EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest(
                "the rendered prompt is empty".into(),
            ));
        }
        if prompt.len() + max_new > self.context_limit {
            return Err(EngineError::PromptTooLong {
                tokens: prompt.len(),
                max_new,
                context: self.context_limit,
            });
        }
        Ok(())
    }

    /// A rollout's rows, decode by decode and seed by seed, with each row's
    /// `(decode_index, sample_index)`.
    pub(super) fn rollout_rows(
        &self,
        decodes: &[DecodeRequest],
        constrained: bool,
    ) -> Result<(Vec<Row>, RowIds), EngineError> {
        let base = if constrained {
            let spec = ConstraintSpec::Contract {
                max_reason_chars: stageb_shared::contract::MAX_REASON_CHARS,
            };
            Some(self.constraint_factory()?.build(&spec)?)
        } else {
            None
        };
        let (mut rows, mut ids) = (Vec::new(), Vec::new());
        for d in decodes {
            let params = check_params(d.temperature, d.top_p, d.repetition_penalty)?;
            if d.max_new_tokens == 0 {
                return Err(EngineError::InvalidRequest(format!(
                    "decode {}: max_new_tokens is 0",
                    d.decode_index
                )));
            }
            if constrained && d.max_new_tokens < MIN_CONSTRAINED_NEW_TOKENS {
                return Err(EngineError::InvalidRequest(format!(
                    "decode {}: max_new_tokens {} is below {MIN_CONSTRAINED_NEW_TOKENS}, the \
                     minimum for a complete constrained verdict",
                    d.decode_index, d.max_new_tokens
                )));
            }
            for (i, &seed) in d.seeds.iter().enumerate() {
                rows.push(Row::new(
                    params,
                    seed,
                    d.max_new_tokens as usize,
                    base.as_ref().map(|c| c.fork()),
                ));
                ids.push((d.decode_index, i as u32));
            }
        }
        Ok((rows, ids))
    }

    /// A generation's one row.
    pub(super) fn generate_row(&self, request: &GenerateRequest) -> Result<Row, EngineError> {
        let params = check_params(
            request.temperature,
            request.top_p,
            request.repetition_penalty,
        )?;
        if request.max_new_tokens == 0 {
            return Err(EngineError::InvalidRequest("max_new_tokens is 0".into()));
        }
        let constraint = match &request.json_schema {
            Some(s) => Some(
                self.constraint_factory()?
                    .build(&ConstraintSpec::JsonSchema(s.clone()))?,
            ),
            None => None,
        };
        Ok(Row::new(
            params,
            request.seed,
            request.max_new_tokens as usize,
            constraint,
        ))
    }

    /// A rollout's output from its ended rows.
    pub(super) fn rollout_output(
        &self,
        rows: &[Row],
        ids: &[(u32, u32)],
        prompt_len: usize,
        reused: usize,
        prefill_us: u64,
        decode_us: u64,
    ) -> Result<RolloutOutput, EngineError> {
        let mut candidates = Vec::with_capacity(rows.len());
        for (row, &(decode_index, sample_index)) in rows.iter().zip(ids) {
            candidates.push(CandidateOutput {
                decode_index,
                sample_index,
                seed: row.seed,
                text: self.row_text(row)?,
                completion_tokens: row.tokens.len() as u32,
                finish: row.finish.unwrap_or(FinishReason::Length),
            });
        }
        Ok(RolloutOutput {
            candidates,
            prompt_tokens: prompt_len as u32,
            prefix_tokens: reused as u32,
            prefill_us,
            decode_us,
            batch: BatchShare::default(),
        })
    }

    /// A generation's output from its ended row.
    pub(super) fn generate_output(
        &self,
        row: &Row,
        prompt_len: usize,
        reused: usize,
        latency_us: u64,
    ) -> Result<GenerateOutput, EngineError> {
        Ok(GenerateOutput {
            text: self.row_text(row)?,
            prompt_tokens: prompt_len as u32,
            prefix_tokens: reused as u32,
            completion_tokens: row.tokens.len() as u32,
            finish: row.finish.unwrap_or(FinishReason::Length),
            latency_us,
            batch: BatchShare::default(),
        })
    }
}
