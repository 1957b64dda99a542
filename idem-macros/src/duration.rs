//! Duration literals of the attribute's options: `"24h"`, `"1h30m"`, `"250ms"`.
//!
//! A literal is one or more `<digits><unit>` groups, units `ms`, `s`, `m`, `h`, `d`,
//! each unit at most once, largest first. Zero, signs, spaces, fractions, a missing or
//! unknown unit, and totals over 100 years (`Options::LONGEST`) are errors: the attribute
//! reports them at the literal, at compile time.

/// The longest duration an option takes: 100 years, `idem::Options::LONGEST`.
const LONGEST_MILLIS: u128 = 36_500 * 86_400_000;

fn too_long(text: &str) -> String {
    format!("duration `{text}` is longer than the longest idem takes, 100 years (\"36500d\")")
}

/// Parses a duration literal into milliseconds.
pub fn parse_millis(text: &str) -> Result<u64, String> {
    const UNITS: [(&str, u128); 5] = [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
        ("ms", 1),
    ];
    if text.is_empty() {
        return Err("empty duration: write e.g. \"24h\", \"1h30m\" or \"90s\"".into());
    }
    if text.starts_with('-') {
        return Err(format!(
            "negative duration `{text}`: durations must be positive"
        ));
    }
    let mut total: u128 = 0;
    // Index into UNITS of the last unit seen, to insist on largest-first, once each.
    let mut last: Option<usize> = None;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!(
                "invalid duration `{text}`: expected a number at `{rest}` (units: ms, s, m, h, d)"
            ));
        }
        let (number, after) = rest.split_at(digits);
        let unit_len = after.bytes().take_while(u8::is_ascii_alphabetic).count();
        let (unit, after) = after.split_at(unit_len);
        if unit.is_empty() {
            return Err(format!(
                "duration `{text}` has no unit after `{number}`: write e.g. `{number}s` (units: ms, s, m, h, d)"
            ));
        }
        let Some(index) = UNITS.iter().position(|(u, _)| *u == unit) else {
            return Err(format!(
                "unknown unit `{unit}` in duration `{text}` (units: ms, s, m, h, d)"
            ));
        };
        if last.is_some_and(|l| index <= l) {
            return Err(format!(
                "duration `{text}`: each unit at most once, largest first (e.g. \"1h30m\")"
            ));
        }
        last = Some(index);
        let value: u128 = number.parse().map_err(|_| too_long(text))?;
        total = value
            .checked_mul(UNITS[index].1)
            .and_then(|v| v.checked_add(total))
            .ok_or_else(|| too_long(text))?;
        rest = after;
    }
    if total > LONGEST_MILLIS {
        return Err(too_long(text));
    }
    if total == 0 {
        return Err(format!(
            "duration `{text}` is zero: it must be greater than zero"
        ));
    }
    u64::try_from(total).map_err(|_| too_long(text))
}

#[cfg(test)]
mod tests {
    use super::parse_millis;
    use proptest::prelude::*;

    #[test]
    fn valid_literals() {
        assert_eq!(parse_millis("24h"), Ok(86_400_000));
        assert_eq!(parse_millis("1h30m"), Ok(5_400_000));
        assert_eq!(parse_millis("7d"), Ok(604_800_000));
        assert_eq!(parse_millis("90s"), Ok(90_000));
        assert_eq!(parse_millis("250ms"), Ok(250));
        assert_eq!(parse_millis("1d2h3m4s5ms"), Ok(93_784_005));
        assert_eq!(parse_millis("0h5m"), Ok(300_000));
        assert_eq!(parse_millis("36500d"), Ok(3_153_600_000_000));
    }

    #[test]
    fn invalid_literals() {
        for bad in [
            "",
            "0s",
            "0h0m",
            "-1h",
            "10",
            "1x",
            "1 h",
            "1.5h",
            "h",
            "1h1h",
            "30m1h",
            "1H",
            "99999999999999999999999999999999999999999d",
            "213503982335d",
            "36501d",
            "36500d1ms",
            "1000000000d",
            "+1h",
            "1h ",
        ] {
            assert!(parse_millis(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    proptest! {
        #[test]
        fn never_panics(s in "\\PC{0,24}") {
            let _ = parse_millis(&s);
        }

        #[test]
        fn round_trips_unit_groups(d in 0u64..1000, h in 0u64..24, m in 0u64..60, s in 1u64..60) {
            let text = format!("{d}d{h}h{m}m{s}s");
            prop_assert_eq!(parse_millis(&text), Ok(((d * 24 + h) * 60 + m) * 60_000 + s * 1000));
        }
    }
}
