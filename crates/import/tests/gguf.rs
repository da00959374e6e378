//! The GGUF reader on files written by the test: metadata of every type, tensor infos, data alignment,
//! dequantization, and errors for broken files.

use pdserve_import::gguf::{GgmlType, GgufFile, Value};
use pdserve_import::ImportError;

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A GGUF v3 file with a few metadata values and two tensors: an F32 [2x3] and a Q8_0 [32].
fn sample() -> Vec<u8> {
    let mut f = b"GGUF".to_vec();
    f.extend(3u32.to_le_bytes());
    f.extend(2u64.to_le_bytes()); // tensors
    f.extend(5u64.to_le_bytes()); // metadata
    string(&mut f, "general.architecture");
    f.extend(8u32.to_le_bytes());
    string(&mut f, "llama");
    string(&mut f, "llama.block_count");
    f.extend(4u32.to_le_bytes());
    f.extend(30u32.to_le_bytes());
    string(&mut f, "llama.rope.freq_base");
    f.extend(6u32.to_le_bytes());
    f.extend(100_000f32.to_le_bytes());
    string(&mut f, "tokenizer.ggml.tokens");
    f.extend(9u32.to_le_bytes());
    f.extend(8u32.to_le_bytes());
    f.extend(2u64.to_le_bytes());
    string(&mut f, "<s>");
    string(&mut f, "hi");
    string(&mut f, "general.alignment");
    f.extend(4u32.to_le_bytes());
    f.extend(64u32.to_le_bytes());
    // Tensor infos.
    string(&mut f, "a.weight");
    f.extend(2u32.to_le_bytes());
    f.extend(3u64.to_le_bytes());
    f.extend(2u64.to_le_bytes());
    f.extend(0u32.to_le_bytes()); // F32
    f.extend(0u64.to_le_bytes());
    string(&mut f, "b.weight");
    f.extend(1u32.to_le_bytes());
    f.extend(32u64.to_le_bytes());
    f.extend(8u32.to_le_bytes()); // Q8_0
    f.extend(64u64.to_le_bytes());
    while !f.len().is_multiple_of(64) {
        f.push(0);
    }
    for v in [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0] {
        f.extend(v.to_le_bytes());
    }
    f.resize(f.len() + 40, 0); // pad to offset 64
    f.extend(0x3800u16.to_le_bytes()); // d = 0.5
    f.extend((0..32).map(|i| (i as i8 - 16) as u8));
    f
}

fn write(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("pdserve-gguf-{}-{name}.gguf", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn reads_metadata_tensors_and_values() {
    let path = write("ok", &sample());
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.get("general.architecture"), Some(&Value::Str("llama".into())));
    assert_eq!(g.u64("llama.block_count").unwrap(), 30);
    assert_eq!(g.f64("llama.rope.freq_base").unwrap(), 100_000.0);
    assert_eq!(g.strings("tokenizer.ggml.tokens").unwrap(), ["<s>", "hi"]);
    let a = g.tensor("a.weight").unwrap();
    assert_eq!((a.shape(), a.ty), (vec![2, 3], GgmlType::F32));
    assert_eq!(g.dequantize(a), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let b = g.tensor("b.weight").unwrap();
    let v = g.dequantize(b);
    assert_eq!((v[0], v[16], v[31]), (-8.0, 0.0, 7.5));
    let _ = std::fs::remove_file(path);
}

#[test]
fn broken_files_are_errors_that_name_the_file() {
    let good = sample();
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    let mut huge_string = good.clone();
    huge_string[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut bad_type = good.clone();
    let at = good.windows(8).position(|w| w == b"a.weight").unwrap() + 8 + 4 + 16;
    bad_type[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("magic", bad_magic),
        ("truncated-header", good[..40].to_vec()),
        ("truncated-data", good[..good.len() - 10].to_vec()),
        ("huge-string", huge_string),
        ("bad-type", bad_type),
    ];
    for (name, bytes) in cases {
        let path = write(name, &bytes);
        let err = GgufFile::open(&path).unwrap_err();
        assert!(
            matches!(err, ImportError::Format { .. } | ImportError::Unsupported { .. }),
            "{name}: {err:?}"
        );
        if let ImportError::Format { path: p, .. } = &err {
            assert_eq!(p, &path, "{name}");
        }
        let _ = std::fs::remove_file(path);
    }
}

/// The k-quants (Q4_K, Q5_K, Q6_K: what `*.Q4_K_M.gguf` files hold) dequantize as the `gguf` Python
/// package (ggml's own reference, independent of this code) does, on random blocks.
#[test]
fn k_quants_match_the_gguf_reference() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for (ty, name, block, halves) in [
        (GgmlType::Q4_K, "Q4_K", 144, &[0usize, 2][..]),
        (GgmlType::Q5_K, "Q5_K", 176, &[0, 2][..]),
        (GgmlType::Q6_K, "Q6_K", 210, &[208][..]),
    ] {
        let blocks = 16;
        let mut raw: Vec<u8> = (0..blocks * block).map(|_| next() as u8).collect();
        // Finite f16 scales between 2^-12 and 1 where the format keeps them.
        for b in 0..blocks {
            for &at in halves {
                let bits = 0x0c00 + (next() % 0x3000) as u16;
                raw[b * block + at..b * block + at + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        let path = write(&format!("{name}.bin"), &raw);
        let out = std::process::Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
            .arg("-c")
            .arg(
                "import sys, numpy as np\nfrom gguf import quants, GGMLQuantizationType as T\n\
                 raw = np.fromfile(sys.argv[1], dtype=np.uint8)\n\
                 v = quants.dequantize(raw, T[sys.argv[2]]).astype('<f4')\n\
                 sys.stdout.buffer.write(v.tobytes())",
            )
            .arg(&path)
            .arg(name)
            .output()
            .expect("python3 runs (with the gguf package: pip install gguf)");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let want: Vec<f32> =
            out.stdout.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let got = pdserve_import::gguf::dequantize(ty, &raw, blocks * 256);
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{name} value {i}: {a} vs the reference's {b}");
        }
        std::fs::remove_file(path).unwrap();
    }
}
