//! Stop strings over streamed text: what may be shown now, and what must wait because it could be
//! the start of a stop string.

/// Splits `pending` at the first stop string: `(text to emit, the index of the stop string found)`; with `include`, the stop
/// string itself is part of the text. Without a stop, the longest tail that could still become a stop
/// string is held back in `pending`.
pub(crate) fn apply_stop(pending: &mut String, stops: &[String], include: bool) -> (String, Option<usize>) {
    if stops.is_empty() {
        return (std::mem::take(pending), None);
    }
    if let Some((at, len, i)) = stops
        .iter()
        .enumerate()
        .filter_map(|(i, s)| pending.find(s.as_str()).map(|at| (at, s.len(), i)))
        .min()
    {
        let out = pending[..if include { at + len } else { at }].to_owned();
        pending.clear();
        return (out, Some(i));
    }
    let mut keep = 0;
    for s in stops {
        for k in (1..s.len().min(pending.len() + 1)).rev() {
            if pending.is_char_boundary(pending.len() - k)
                && s.is_char_boundary(k)
                && pending.ends_with(&s[..k])
            {
                keep = keep.max(k);
                break;
            }
        }
    }
    let cut = pending.len() - keep;
    let out = pending[..cut].to_owned();
    pending.drain(..cut);
    (out, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_hold_back_possible_prefixes() {
        let stops = vec!["END".to_owned(), "\n\n".to_owned()];
        let mut p = String::from("hello E");
        assert_eq!(apply_stop(&mut p, &stops, false), ("hello ".into(), None));
        assert_eq!(p, "E");
        p.push_str("NDING");
        assert_eq!(apply_stop(&mut p, &stops, false), ("".into(), Some(0)));
        let mut p = String::from("a\nb\n");
        assert_eq!(apply_stop(&mut p, &stops, false), ("a\nb".into(), None));
        let mut p = String::from("x");
        assert_eq!(apply_stop(&mut p, &[], false), ("x".into(), None));
        let mut p = String::from("say END now");
        assert_eq!(apply_stop(&mut p, &stops, true), ("say END".into(), Some(0)));
    }
}
