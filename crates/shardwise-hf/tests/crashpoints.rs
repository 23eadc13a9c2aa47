//! Every crash point of a from-hf and a to-hf commit, as a process death and as a power loss
//! (`shardwise::crashtest`; the save and merge they share with every save are in the core's
//! tests/crashpoints.rs). from-hf: the checkpoint is committed and whole or not committed with a
//! cause, the tracker names only a committed iteration, the HF folder is unchanged, a rerun
//! commits. to-hf: an index is there only over the whole conversion (every file byte-identical to
//! an uninterrupted one), the checkpoint is unchanged, a rerun commits. Counts and times:
//! docs/guarantees.md ("Every crash point").

use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};
use shardwise::crashtest::{after_restart, committed_and_whole, enumerate};
use shardwise::crashtest::{status_and_verify_agree, Scenario, Summary};
use shardwise::storage::Location;
use shardwise_hf::{from_hf, to_hf, FromHfOptions, FromHfRequest, HfOptions, ToHfRequest};

const HF: &str = "hf";
const CKPT: &str = "save_root/iter_0000001";
const TRACKER: &str = "save_root/latest_checkpointed_iteration.txt";
const OUT: &str = "out";
const REFERENCE: &str = "reference";
const INDEX: &str = "model.safetensors.index.json";

/// A llama of one layer (hidden 16, 2 heads of 8, 1 KV head, FFN 32, vocabulary 256) in float32,
/// its values a function of the tensor's index and position.
fn tiny_llama(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let config = r#"{"model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "hidden_act": "silu", "attention_bias": false,
        "mlp_bias": false, "torch_dtype": "float32"}"#;
    std::fs::write(dir.join("config.json"), config).unwrap();
    let l = "model.layers.0";
    let shapes: Vec<(String, Vec<usize>)> = [
        ("model.embed_tokens.weight".to_string(), vec![256, 16]),
        (format!("{l}.input_layernorm.weight"), vec![16]),
        (format!("{l}.self_attn.q_proj.weight"), vec![16, 16]),
        (format!("{l}.self_attn.k_proj.weight"), vec![8, 16]),
        (format!("{l}.self_attn.v_proj.weight"), vec![8, 16]),
        (format!("{l}.self_attn.o_proj.weight"), vec![16, 16]),
        (format!("{l}.post_attention_layernorm.weight"), vec![16]),
        (format!("{l}.mlp.gate_proj.weight"), vec![32, 16]),
        (format!("{l}.mlp.up_proj.weight"), vec![32, 16]),
        (format!("{l}.mlp.down_proj.weight"), vec![16, 32]),
        ("model.norm.weight".to_string(), vec![16]),
        ("lm_head.weight".to_string(), vec![256, 16]),
    ]
    .into_iter()
    .collect();
    let bytes: Vec<Vec<u8>> = shapes
        .iter()
        .enumerate()
        .map(|(t, (_, shape))| {
            let n: usize = shape.iter().product();
            (0..n)
                .flat_map(|i| (((t * 131 + i * 7) % 97) as f32 / 97.0 - 0.5).to_le_bytes())
                .collect()
        })
        .collect();
    let views: Vec<(String, TensorView)> = shapes
        .iter()
        .zip(&bytes)
        .map(|((name, shape), b)| {
            let view = TensorView::new(Dtype::F32, shape.clone(), b).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// from-hf of the tiny llama into `ckpt` as iteration 1, with the tracker.
fn convert_in(root: &Path, ckpt: &Path, overwrite: bool) -> shardwise::Result<()> {
    let opts = FromHfOptions::from_user(FromHfRequest {
        iteration: 1,
        tracker: true,
        workers: Some(1),
        overwrite,
        ..FromHfRequest::default()
    })?;
    from_hf(&root.join(HF), ckpt, &opts, &|_| {}).map(|_| ())
}

/// to-hf of the checkpoint into `out`, in shards of at most 4 KB (several files).
fn export(root: &Path, out: &Path, overwrite: bool) -> shardwise::Result<()> {
    let opts = HfOptions::from_user(ToHfRequest {
        arch: Some("llama".into()),
        max_shard_size: "4KB".into(),
        workers: Some(1),
        overwrite,
        ..ToHfRequest::default()
    })?;
    let ckpt = Location::local(&root.join(CKPT));
    to_hf(&ckpt, out, &opts, &|_| {}).map(|_| ())
}

fn report(name: &str, s: &Summary) {
    eprintln!(
        "crashpoints {name}: {} points, {} states ({} power loss), {} violations, {:.1} s",
        s.points,
        s.states,
        s.power_states,
        s.violations.len(),
        s.seconds
    );
    for (step, n) in &s.steps {
        eprintln!("  {step}: {n}");
    }
    let shown: Vec<&str> = s.violations.iter().take(40).map(|v| v.as_str()).collect();
    assert!(
        s.violations.is_empty(),
        "{} violations:\n{}",
        s.violations.len(),
        shown.join("\n")
    );
    assert!(s.points > 10 && s.power_states > 0, "too few points: {s:?}");
}

/// The tracker, when there, names iteration 1 and that iteration is committed.
fn tracker_names_a_commit(root: &Path, committed: bool, done: bool) -> Vec<String> {
    match std::fs::read(root.join(TRACKER)) {
        Ok(b) if b == b"1" && committed => vec![],
        Ok(b) => vec![format!(
            "the tracker holds {:?}, committed: {committed}",
            String::from_utf8_lossy(&b)
        )],
        Err(_) if done => vec!["the tracker is missing although from-hf returned".into()],
        Err(_) => vec![],
    }
}

/// from-hf into a new iteration folder, with the tracker.
#[test]
fn from_hf_commit() {
    let s = enumerate(&Scenario {
        test: "from_hf_commit",
        setup: |root| tiny_llama(&root.join(HF)),
        run: |root| convert_in(root, &root.join(CKPT), false),
        untouched: &[HF],
        check: |root, done| {
            let ckpt = root.join(CKPT);
            let (mut v, committed) = status_and_verify_agree(&ckpt);
            if done && !committed {
                v.push("not committed although from-hf returned".into());
            }
            v.extend(tracker_names_a_commit(root, committed, done));
            after_restart(&ckpt);
            match convert_in(root, &ckpt, true) {
                Ok(()) => {
                    v.extend(committed_and_whole(&ckpt, "after the rerun"));
                    v.extend(tracker_names_a_commit(root, true, true));
                }
                Err(e) => v.push(format!("the rerun (--overwrite) fails: {e}")),
            }
            v
        },
    });
    report("from-hf", &s);
}

/// Every file of the uninterrupted conversion `REFERENCE` is in `out`, byte for byte.
fn same_as_reference(root: &Path, out: &Path) -> Vec<String> {
    let reference = root.join(REFERENCE);
    let mut v = Vec::new();
    for e in std::fs::read_dir(&reference).unwrap().flatten() {
        let name = e.file_name();
        if std::fs::read(e.path()).ok() != std::fs::read(out.join(&name)).ok() {
            v.push(format!(
                "{} differs from the uninterrupted conversion's",
                name.to_string_lossy()
            ));
        }
    }
    v
}

/// to-hf into a new folder: its index appears only over the whole conversion.
#[test]
fn to_hf_commit() {
    let s = enumerate(&Scenario {
        test: "to_hf_commit",
        setup: |root| {
            tiny_llama(&root.join(HF));
            convert_in(root, &root.join(CKPT), false).expect("from-hf");
            export(root, &root.join(REFERENCE), false).expect("the reference conversion");
        },
        run: |root| export(root, &root.join(OUT), false),
        untouched: &[CKPT, REFERENCE],
        check: |root, done| {
            let out = root.join(OUT);
            let mut v = Vec::new();
            if out.join(INDEX).exists() {
                v.extend(same_as_reference(root, &out));
            } else if done {
                v.push("the index is missing although to-hf returned".into());
            }
            match export(root, &out, true) {
                Ok(()) => v.extend(same_as_reference(root, &out)),
                Err(e) => v.push(format!("the rerun (--overwrite) fails: {e}")),
            }
            v
        },
    });
    report("to-hf", &s);
}
