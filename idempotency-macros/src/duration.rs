//! Durations written as strings (`"30s"`, `"15m"`, `"24h"`, `"7d"`, `"1h 30m"`), checked at
//! compile time.

/// The longest duration an argument may hold: a record kept for more than a year is a typo,
/// not a policy.
pub(crate) const MAX_MILLIS: u64 = 365 * MILLIS_PER_DAY;

const MILLIS_PER_DAY: u64 = 24 * 60 * 60 * 1000;

/// The units a duration may use, longest suffix first so `ms` is not read as `m`.
const UNITS: [(&str, u64); 5] = [
    ("ms", 1),
    ("s", 1000),
    ("m", 60 * 1000),
    ("h", 60 * 60 * 1000),
    ("d", MILLIS_PER_DAY),
];

/// What is wrong with a duration string; rendered into the compile error.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum DurationError {
    /// Not `<number><unit>` groups.
    Syntax,
    /// Adds up to zero.
    Zero,
    /// Longer than [`MAX_MILLIS`].
    TooLong,
}

/// Parses one or more `<digits><unit>` groups, optionally separated by spaces, into
/// milliseconds. Units: `ms`, `s`, `m`, `h`, `d`.
pub(crate) fn parse_millis(text: &str) -> Result<u64, DurationError> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(DurationError::Syntax);
    }
    // Summed in u128 so that no input overflows before it is found too long.
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(DurationError::Syntax);
        }
        let (number, after) = rest.split_at(digits);
        let (unit, factor) = UNITS
            .iter()
            .find(|(unit, _)| {
                after.starts_with(unit)
                    && !after[unit.len()..].starts_with(|c: char| c.is_ascii_alphabetic())
            })
            .ok_or(DurationError::Syntax)?;
        // More than 39 digits cannot be a sensible duration; treat it as too long rather than
        // failing to parse the number.
        let number = number.parse::<u128>().unwrap_or(u128::MAX);
        total = total.saturating_add(number.saturating_mul(u128::from(*factor)));
        rest = after[unit.len()..].trim_start();
    }
    if total == 0 {
        return Err(DurationError::Zero);
    }
    u64::try_from(total)
        .ok()
        .filter(|millis| *millis <= MAX_MILLIS)
        .ok_or(DurationError::TooLong)
}

#[cfg(test)]
mod tests {
    use super::{DurationError, MAX_MILLIS, parse_millis};

    #[test]
    fn reads_every_unit() {
        assert_eq!(parse_millis("250ms"), Ok(250));
        assert_eq!(parse_millis("30s"), Ok(30_000));
        assert_eq!(parse_millis("15m"), Ok(900_000));
        assert_eq!(parse_millis("24h"), Ok(86_400_000));
        assert_eq!(parse_millis("7d"), Ok(604_800_000));
    }

    #[test]
    fn adds_up_groups_with_or_without_spaces() {
        assert_eq!(parse_millis("1h30m"), Ok(5_400_000));
        assert_eq!(parse_millis(" 1h 30m 15s "), Ok(5_415_000));
        assert_eq!(parse_millis("1m500ms"), Ok(60_500));
    }

    #[test]
    fn refuses_what_is_not_number_and_unit() {
        for text in [
            "", " ", "24", "h", "24 h", "1.5h", "-1h", "24hours", "2w", "1h30", "tomorrow", "1H",
            "1msx",
        ] {
            assert_eq!(parse_millis(text), Err(DurationError::Syntax), "{text:?}");
        }
    }

    #[test]
    fn refuses_zero() {
        assert_eq!(parse_millis("0s"), Err(DurationError::Zero));
        assert_eq!(parse_millis("0h 0ms"), Err(DurationError::Zero));
    }

    #[test]
    fn refuses_more_than_a_year() {
        assert_eq!(parse_millis("365d"), Ok(MAX_MILLIS));
        assert_eq!(parse_millis("365d1ms"), Err(DurationError::TooLong));
        assert_eq!(parse_millis("8761h"), Err(DurationError::TooLong));
        assert_eq!(
            parse_millis("99999999999999999999999999999999999999999999d"),
            Err(DurationError::TooLong)
        );
    }
}
