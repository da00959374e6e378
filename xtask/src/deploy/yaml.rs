//! JSON values written as block-style YAML (the subset Kubernetes manifests use: maps, lists,
//! strings, numbers, booleans, null). Keys in alphabetical order, as `kubectl get -o yaml` writes
//! them (and whatever order the JSON map keeps); strings YAML could read as something else quoted.

use serde_json::Value;

/// Appends `v` as a YAML document (without the `---` line).
pub(crate) fn write(v: &Value, out: &mut String) {
    match v {
        Value::Object(_) | Value::Array(_) => block(v, 0, out),
        scalar => {
            out.push_str(&inline(scalar));
            out.push('\n');
        }
    }
}

fn pad(n: usize, out: &mut String) {
    out.extend(std::iter::repeat_n(' ', n));
}

fn is_empty_collection(v: &Value) -> bool {
    matches!(v, Value::Object(m) if m.is_empty()) || matches!(v, Value::Array(a) if a.is_empty())
}

/// A map or list whose first line starts at the current position, indented by `indent`.
fn block(v: &Value, indent: usize, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<(&String, &Value)> = m.iter().collect();
            keys.sort_by_key(|(k, _)| k.as_str());
            for (i, (k, val)) in keys.into_iter().enumerate() {
                if i > 0 {
                    pad(indent, out);
                }
                out.push_str(&string(k));
                out.push(':');
                value_after_key(val, indent, out);
            }
        }
        Value::Array(a) => {
            for (i, item) in a.iter().enumerate() {
                if i > 0 {
                    pad(indent, out);
                }
                out.push_str("- ");
                match item {
                    Value::Object(_) | Value::Array(_) if !is_empty_collection(item) => {
                        block(item, indent + 2, out)
                    }
                    _ => {
                        out.push_str(&inline(item));
                        out.push('\n');
                    }
                }
            }
        }
        scalar => {
            out.push_str(&inline(scalar));
            out.push('\n');
        }
    }
}

fn value_after_key(val: &Value, indent: usize, out: &mut String) {
    match val {
        Value::Object(_) if !is_empty_collection(val) => {
            out.push('\n');
            pad(indent + 2, out);
            block(val, indent + 2, out);
        }
        // Lists sit at their key's indentation, as kubectl writes them.
        Value::Array(_) if !is_empty_collection(val) => {
            out.push('\n');
            pad(indent, out);
            block(val, indent, out);
        }
        _ => {
            out.push(' ');
            out.push_str(&inline(val));
            out.push('\n');
        }
    }
}

fn inline(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => string(s),
        Value::Object(_) => "{}".into(),
        Value::Array(_) => "[]".into(),
    }
}

/// A string plain where YAML reads it back as the same string, else double-quoted.
fn string(s: &str) -> String {
    let reserved = ["true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"];
    let looks_like_other = reserved.contains(&s.to_ascii_lowercase().as_str())
        || s.parse::<f64>().is_ok()
        || s.starts_with(|c: char| c.is_ascii_digit() || c == '.' || c == '+')
        || s == "-"
        || s.starts_with("- ");
    let plain_chars =
        s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:$()@".contains(c)) && !s.contains(": ");
    if !s.is_empty()
        && plain_chars
        && !looks_like_other
        && !s.ends_with(':')
        && !s.starts_with(['$', ':', '@'])
    {
        s.to_owned()
    } else {
        serde_json::to_string(s).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn maps_lists_and_quoting() {
        let v = json!({
            "kind": "Service",
            "spec": {
                "clusterIP": "None",
                "ports": [{"name": "http", "port": 8000}, {"name": "kv", "port": 8100}],
                "args": ["--port", "8000", "$(POD_IP):8100", "on", "a: b", ""],
                "empty": {},
                "none": [],
                "flag": true,
            },
        });
        let mut out = String::new();
        write(&v, &mut out);
        let want = "\
kind: Service
spec:
  args:
  - --port
  - \"8000\"
  - \"$(POD_IP):8100\"
  - \"on\"
  - \"a: b\"
  - \"\"
  clusterIP: None
  empty: {}
  flag: true
  none: []
  ports:
  - name: http
    port: 8000
  - name: kv
    port: 8100
";
        assert_eq!(out, want);
    }
}
